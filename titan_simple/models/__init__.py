"""Model definitions. Llama 3 is the only family; see ``llama3.py``."""

from titan_simple.models.llama3 import (
    LLAMA3_FLAVORS,
    ModelArgs,
    Transformer,
    build_model,
    count_parameters,
    flops_per_token,
)

__all__ = ["LLAMA3_FLAVORS", "ModelArgs", "Transformer", "build_model", "count_parameters", "flops_per_token"]
