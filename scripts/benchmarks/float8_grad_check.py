"""How far float8 linears are from bf16 on this device, layer by layer: one Llama 3 block of a flavor's dims, the same
input and weights, eager and compiled, for each float8 recipe.

    python scripts/benchmarks/float8_grad_check.py                     # 8B's dims, 2048 tokens, on the GPU (or the CPU)
    python scripts/benchmarks/float8_grad_check.py --flavor debugmodel --tokens 256

Prints, per recipe and mode, the output's and each weight gradient's error relative to bf16's (max |x - ref| over
max |ref|). float8 (e4m3, 3 mantissa bits) rounds each operand by up to 2^-4, so a few percent is float8; ten
times more in one layer points at that layer's matmul, not at float8's rounding.
"""

from __future__ import annotations

import argparse
import copy

import torch  # noqa: E402

from titan_simple.models.float8 import convert_to_float8  # noqa: E402
from titan_simple.models.llama3 import LLAMA3_FLAVORS, TransformerBlock, precompute_freqs_cis  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def run(block: torch.nn.Module, x: torch.Tensor, freqs: torch.Tensor,
        forward=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    out = (block if forward is None else forward)(x, freqs)
    out.float().pow(2).mean().backward()
    return out.detach(), {name: p.grad.detach().clone() for name, p in block.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_args = LLAMA3_FLAVORS[args.flavor]
    torch.manual_seed(0)
    reference_block = TransformerBlock(0, model_args).to(device=device, dtype=torch.bfloat16)
    for p in reference_block.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    freqs = precompute_freqs_cis(model_args.head_dim, args.tokens, model_args.rope_theta).to(device)
    x = torch.randn(1, args.tokens, model_args.dim, device=device, dtype=torch.bfloat16)
    ref_out, ref_grads = run(reference_block, x, freqs)
    print(f"{device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''} torch {torch.__version__}, "
          f"{args.flavor} block, {args.tokens} tokens; error relative to bf16 (max abs diff / max abs reference)")
    names = [n for n in ref_grads if n.endswith("weight") and "norm" not in n]
    print(f"{'recipe':<20} {'mode':<9} {'output':>8} " + " ".join(f"{n.split('.')[-2]:>8}" for n in names))
    for recipe in RECIPES:
        for mode in ("eager", "compiled"):
            block = copy.deepcopy(reference_block)
            convert_to_float8(block, recipe, [], emulate=device.type == "cpu")
            try:
                out, grads = run(block, x, freqs, torch.compile(block) if mode == "compiled" else None)
            except Exception as e:  # noqa: BLE001 -- report and go on with the next recipe
                print(f"{recipe:<20} {mode:<9} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                continue
            errors = [relative_error(grads[n], ref_grads[n]) for n in names]
            print(f"{recipe:<20} {mode:<9} {relative_error(out, ref_out):8.4f} "
                  + " ".join(f"{e:8.4f}" for e in errors), flush=True)


if __name__ == "__main__":
    main()
