"""The model stays plain: ``Transformer.forward(tokens, attention_inputs=None)``, and no parallelism or compile sets an
attribute on the model or its modules, nor wraps one. They swap a module's class for a subclass (SimpleFSDP,
activation checkpointing, context parallel, regional compilation) or use torch's own module APIs (tensor parallel's
hooks, FSDP2, ``nn.Module.compile``); what a compile records, the run keeps (``ModelParts.comm_plan_recorders``).

Each layout is the trainer's assembly (``core/assemble.build_run``) on one rank of a fake process group, left on
the meta device, as the dry run builds it: no step runs and nothing compiles (``nn.Module.compile`` is lazy)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from tests.parity import Recipe
from titan_simple.compile.regions import regions_of
from titan_simple.core.assemble import build_run
from titan_simple.core.plan import resolve_plan
from titan_simple.models.attention import AttentionInputs, KVCache
from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer
from titan_simple.parallel.context_parallel import ContextParallelAttention
from titan_simple.parallel.fake_process_group import init_fake_process_group

RECIPE = Recipe(extra=("--model.n_layers=4",))
DP2 = ("--parallelism.data_parallel_shard_degree=2",)
PP2 = ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=1")
COMPILE = ("--compile.enable",)
# name: (world size, overrides, compile mode, comm plan recorders the run keeps)
LAYOUTS = {
    "single": (1, (), "off", 0),
    "fully_shard_selective_ac": (2, (*DP2, "--activation_checkpoint.mode=selective"), "off", 0),
    "hybrid_shard_full_ac": (4, (*DP2, "--parallelism.data_parallel_replicate_degree=2",
                                 "--activation_checkpoint.mode=full"), "off", 0),
    "fsdp2": (2, (*DP2, "--parallelism.fsdp_implementation=fsdp2"), "off", 0),
    "tp2": (2, ("--parallelism.tensor_parallel_degree=2",), "off", 0),
    "pp2": (2, PP2, "off", 0),
    "cp2_tp2": (4, ("--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2"), "off", 0),
    "compiled_with_loss": (2, (*DP2, *COMPILE), "whole_with_loss", 1),
    "compiled_tp2": (2, ("--parallelism.tensor_parallel_degree=2", *COMPILE), "whole", 1),
    "compiled_cp2": (2, ("--parallelism.context_parallel_degree=2", *COMPILE), "whole_with_loss", 1),
    "regional_handoff": (2, (*DP2, *COMPILE, "--compile.regional"), "regional", 1),
    "regional_pp2_two_stages": (2, (*PP2, "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", *COMPILE,
                                    "--compile.regional"), "regional", 1),
    "per_block_fsdp2": (2, (*DP2, "--parallelism.fsdp_implementation=fsdp2", *COMPILE), "per_block", 0),
}

# What a build may add to a module's own attributes: the state of one of our class swaps (the swapped-in class
# reads it; the module's class must then be swapped) and the state of torch's own module APIs. Anything else is a
# parallelism or the compiler leaving something on the model.
CLASS_SWAP_STATE = {
    "_gather_specs": "SimpleFSDP's gathering parameters (parallel/simple_fsdp.py; tensor parallel's gradients too)",
    "_checkpoint_policy": "activation checkpointing's class (parallel/activation_checkpoint.py)",
    "_checkpoint_context_fn": "activation checkpointing's class",
}
TORCH_STATE = {
    "_compiled_call_impl": "nn.Module.compile",
    "_distribute_module_applied": "tensor parallel's parallelize_module",
    "_is_fsdp_managed_module": "FSDP2's fully_shard",
    "_fsdp_use_orig_params": "FSDP2's fully_shard",
}
TORCH_STATE_PREFIX = "__composable_api_state_key_"  # FSDP2's fully_shard (torch's composable API registry)
PLAIN_VALUE_TYPES = (type(None), bool, int, float, str, tuple)


def test_forward_takes_the_tokens_and_one_attention_inputs_argument():
    parameters = list(inspect.signature(Transformer.forward).parameters.values())
    assert [(p.name, p.default) for p in parameters[1:]] == [("tokens", inspect.Parameter.empty),
                                                             ("attention_inputs", None)]


def _build(world_size: int, overrides: tuple[str, ...]):
    """The layout's plan and this rank's built run (rank 0 of a fake ``world_size``-rank job)."""
    plan = resolve_plan(RECIPE.config(*overrides), world_size, "cpu")
    mesh = plan.dims.build_mesh("cpu") if world_size > 1 else None
    return plan, build_run(plan, torch.device("meta"), mesh=mesh, materialize=False, lr_schedule=False)


def _what_the_build_added(part: nn.Module, plain: nn.Module) -> list[str]:
    """Every module of ``part`` against the plain model's module of the same name: the same module names, each a
    subclass of its plain class, its plain attributes' values unchanged, and only the allowed state added."""
    found, plain_modules = [], dict(plain.named_modules())
    for fqn, module in part.named_modules():
        name = fqn or "model"
        if fqn not in plain_modules:
            found.append(f"{name}: a module the plain model does not have ({type(module).__name__})")
            continue
        reference = plain_modules[fqn]
        if not isinstance(module, type(reference)):
            found.append(f"{name}: {type(module).__name__} replaced {type(reference).__name__}")
        added = set(vars(module)) - set(vars(reference))
        for key in sorted(added):
            swapped = type(module) is not type(reference)
            if key in TORCH_STATE or key.startswith(TORCH_STATE_PREFIX) or (key in CLASS_SWAP_STATE and swapped):
                continue
            found.append(f"{name}.{key} set on the module")
        found += [f"{name}.{key} changed from {value!r}" for key, value in vars(reference).items()
                  if isinstance(value, PLAIN_VALUE_TYPES) and getattr(module, key, value) != value]
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_layout_sets_an_attribute_on_the_model_or_wraps_a_module(layout):
    """After each layout's build, every module of the model (or of this rank's pipeline stages) is the plain
    model's module of that name: its class or a subclass swapped in, its attributes as the plain model's
    ``__init__`` set them plus only a class swap's or torch's own state. Compiled layouts keep their comm plan
    recorders in the run."""
    world_size, overrides, mode, recorders = LAYOUTS[layout]
    init_fake_process_group(0, world_size)
    try:
        plan, run = _build(world_size, overrides)
        with torch.device("meta"):
            plain = Transformer(plan.model_args, attention=plan.attention.kernel)
        added = [line for part in run.parts.modules for line in _what_the_build_added(part, plain)]
        assert (plan.compile.mode, len(run.parts.comm_plan_recorders), added) == (mode, recorders, [])
        if plan.compile.mode == "regional":
            assert all(regions_of(part) is not None for part in run.parts.modules)
        if plan.dims.cp > 1:
            assert all(isinstance(m.attention, ContextParallelAttention) for m in run.parts.modules[0].layers.values())
    finally:
        dist.destroy_process_group()


def test_pipeline_schedules_split_the_attention_inputs_per_microbatch():
    """torch's pipeline schedules split a stage's keyword inputs with pytree: each tensor of ``AttentionInputs`` is
    cut along the batch dim into microbatches, like the tokens; absent inputs stay None and a cache goes whole."""
    ids = torch.arange(12).view(4, 3)
    cache = KVCache(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=1), 4, 3, "cpu", torch.float32)
    _, chunks = split_args_kwargs_into_chunks(
        (torch.zeros(4, 3),), {"attention_inputs": AttentionInputs(document_ids=ids, cache=cache)}, 2)
    split = [chunk["attention_inputs"] for chunk in chunks]
    assert [inputs.document_ids.tolist() for inputs in split] == [ids[:2].tolist(), ids[2:].tolist()]
    assert [(inputs.positions, inputs.cache) for inputs in split] == [(None, cache)] * 2
