"""Tokenizer and data pipeline: text -> token ids -> packed ``(inputs, labels)`` batches per rank."""

from titan_simple.data.datasets import build_dataloader
from titan_simple.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["Tokenizer", "build_dataloader", "build_tokenizer"]
