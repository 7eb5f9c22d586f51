"""Float8 training through torchao (``[model] converters = ["float8"]``, configured in ``[float8]``).

torchao's ``Float8Linear`` is an ``nn.Linear`` whose forward casts its input and weight to float8 (e4m3) with a
scale, multiplies them with ``torch._scaled_mm`` and, in backward, does the same for the gradients: the matmuls run
at the GPU's float8 rate (H100: 1,979 dense TFLOP/s against 989 in bf16), everything else stays as it was. The
swap happens here, on the meta model, before tensor parallel, activation checkpointing, SimpleFSDP and compile:
each of those then sees ordinary modules with ordinary ``weight`` parameters, and a checkpoint keeps the
parameters' own dtype (a float8 run's checkpoint loads without float8 and the reverse).

Which linears: every ``nn.Linear`` but those whose name contains one of ``[float8] filter_fqns`` (default the
output projection) and those whose dimensions are not multiples of 16 (float8 matmuls need them).
``float8_targets`` decides, so the plan can count before anything is built.

On CUDA the matmuls need compute capability 8.9+. On CPU the matmul is emulated (``convert_to_float8``): for
tests and numerics, never for speed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titan_simple.config import Float8
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import ModelArgs, Transformer

ALIGNMENT = 16  # float8 matmuls need both dimensions of a weight to be multiples of this
MIN_CUDA_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores
INSTALL_HINT = "pip install -e '.[float8]' (torchao)"


@dataclass(frozen=True)
class Float8Targets:
    """The model's linears by what float8 does with them (fully qualified names)."""

    converted: tuple[str, ...]
    filtered: tuple[str, ...]  # named in [float8] filter_fqns: kept in high precision
    misaligned: tuple[str, ...]  # a dimension not a multiple of ALIGNMENT: kept in high precision

    def describe(self, recipe: str) -> str:
        kept = []
        if self.filtered:
            kept.append(f"{len(self.filtered)} by filter_fqns")
        if self.misaligned:
            kept.append(f"{len(self.misaligned)} with dims not multiples of {ALIGNMENT}")
        return (f"float8 {recipe}: {len(self.converted)} linears"
                + (f", {' and '.join(kept)} kept in high precision" if kept else ""))


# (linear's name, in_features, out_features) -> this rank's (in, out) under tensor parallel.
LocalShape = Callable[[str, int, int], tuple[int, int]]


def float8_targets(model: nn.Module, filter_fqns: list[str], local_shape: LocalShape | None = None) -> Float8Targets:
    """Which linears convert. A float8 matmul needs both of its dims to be multiples of ``ALIGNMENT`` on the rank
    that runs it: under tensor parallel (``local_shape``, ``tensor_parallel.local_linear_shape``) that is the
    shard, ``in / tp`` of a row-parallel linear and ``out / tp`` of a column-parallel one."""
    converted, filtered, misaligned = [], [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        dims = (module.in_features, module.out_features)
        if local_shape is not None:
            dims = (*dims, *local_shape(name, *dims))
        if any(fragment in name for fragment in filter_fqns):
            filtered.append(name)
        elif any(d % ALIGNMENT for d in dims):
            misaligned.append(name)
        else:
            converted.append(name)
    return Float8Targets(tuple(converted), tuple(filtered), tuple(misaligned))


@dataclass(frozen=True)
class Float8Plan:
    recipe: str
    filter_fqns: tuple[str, ...]
    targets: Float8Targets
    emulate: bool  # CPU: float8 casts, fp32 matmuls (convert_to_float8)
    all_gather: bool = False  # SimpleFSDP gathers the float8 weights in float8 (parallel/float8_gather.py)
    all_gather_note: str = ""  # why the weights are gathered in the param dtype instead ("": no all-gathers)
    tensor_parallel: bool = False  # torchao's float8 TP styles: activations all-gathered in float8 (tensorwise)

    def describe(self) -> str:
        """The plan line's float8 part. MFU keeps the bf16 peak as its denominator (it counts the model's FLOPs,
        not which unit ran them), so a float8 run can read above what bf16 reaches: the line says so."""
        where = " (matmuls emulated on CPU)" if self.emulate else "; mfu is against the bf16 peak"
        gather = ("; weights all-gathered in float8" if self.all_gather else
                  f"; weights all-gathered in the param dtype ({self.all_gather_note})" if self.all_gather_note else "")
        tp = "; TP activations all-gathered in float8" if self.tensor_parallel else ""
        return self.targets.describe(self.recipe) + gather + tp + where


def plan_float8_parallel(plan: Float8Plan | None, wanted: bool, dims, fsdp_implementation: str) -> Float8Plan | None:
    """Whether SimpleFSDP gathers the float8 weights in float8, and if not, why (for the plan line); whether tensor
    parallel uses torchao's float8 styles (tensorwise: one scale per activation, so a rank can cast its shard before
    the all-gather; rowwise keeps the plain styles)."""
    if plan is None:
        return plan
    plan = dataclasses.replace(plan, tensor_parallel=dims.tp > 1 and plan.recipe == "tensorwise")
    if not dims.wraps_data_parallel or dims.data_parallel_mode == "replicate":
        return plan  # no all-gathers to shrink
    why = ("[float8] all_gather = false" if not wanted else
           "rowwise scales each row, and its backward the columns: no one float8 copy to gather"
           if plan.recipe != "tensorwise" else
           "FSDP2" if fsdp_implementation != "simple" else
           "")
    return dataclasses.replace(plan, all_gather=not why, all_gather_note=why)


def plan_float8(converters: list[str], config: Float8, model_args: ModelArgs, device_type: str,
                planning: bool = False, local_shape: LocalShape | None = None) -> Float8Plan | None:
    """Which linears become float8 (counted on a meta model; ``local_shape``: their shards under tensor parallel),
    or None without the converter; the one-line error if float8 cannot run here (no torchao, a GPU without float8
    matmuls). ``planning`` (the dry run): the GPU planned for is not this machine's; the dry run checks its device
    table instead."""
    if "float8" not in converters:
        return None
    problem = float8_problem("cpu" if planning else device_type)
    if problem is not None:
        raise ConfigError(problem)
    with torch.device("meta"):
        targets = float8_targets(Transformer(model_args), config.filter_fqns, local_shape)
    return Float8Plan(recipe=config.recipe, filter_fqns=tuple(config.filter_fqns), targets=targets,
                      emulate=device_type == "cpu")


def float8_problem(device_type: str) -> str | None:
    """Why float8 training cannot run here (one line, with the fix), or None."""
    # torchao's import warns about kernels float8 training does not use (mxfp8 / cutlass extensions built for other
    # torch versions, triton int matmuls on CPU builds) and torch about a pytree registration it deprecates: kept out
    # of the log.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401, PLC0415 -- an optional dependency, imported only when asked for
    except ImportError:
        return f"[model] converters = ['float8'] needs torchao, which is not installed: {INSTALL_HINT}"
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CUDA_CAPABILITY:
            return (f"[model] converters = ['float8'] needs float8 matmuls (compute capability 8.9+: H100, H200, "
                    f"L40S, RTX 4090); {torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}: drop "
                    "float8 from [model] converters")
    return None


def convert_to_float8(model: nn.Module, recipe: str, filter_fqns: list[str], emulate: bool,
                      targets: Float8Targets | None = None) -> Float8Targets:
    """Swap ``model``'s target linears for torchao's ``Float8Linear`` (in place) and say which were swapped:
    ``targets`` (the plan's, which knows the tensor-parallel shards), or ``float8_targets`` of the whole linears.
    ``emulate`` (CPU): torchao's emulation, every cast to float8 real but the matmul in fp32 on the dequantized
    values, the same numbers up to the accumulation order; CPU's own ``torch._scaled_mm`` is a reference kernel
    about 250 times slower than an fp32 matmul (measured: 4 s for 512 x 256 x 768)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415 -- optional

    targets = targets or float8_targets(model, filter_fqns)
    chosen = set(targets.converted)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return targets
