"""Run TorchTitan's trainer on the side-by-side shape (scripts/benchmarks/torchtitan_side_by_side.sh), one process
per GPU.

    torchrun --standalone --nproc_per_node=1 scripts/benchmarks/torchtitan_launch.py {fsdp2|simplefsdp} \
        [trainer flags...]

TorchTitan has no ``--model.n_layers``: this launcher registers one more flavor in its llama3 registry,
``side_by_side``, and runs TorchTitan's own entry point (``torchtitan.train.main``) on it.

* ``fsdp2``: TorchTitan's llama3 trainer: FSDP2 (``fully_shard``; on one GPU a 1-rank mesh, which still applies
  its bf16 MixedPrecisionPolicy), selective op AC, per-block ``torch.compile`` of the model and the loss.
* ``simplefsdp``: TorchTitan's SimpleFSDP path. 0.3.x: the graph_trainer (experiments/graph_trainer: SimpleFSDP
  + the whole forward, loss and backward traced by make_fx and compiled, CUDA graphs on GPU). 0.2.x:
  ``--model.name simple_fsdp.llama3`` (experiments/simple_fsdp) with the whole model compiled.

Environment (all optional):
  TT_DIMS     8b (default): Llama 3 8B's blocks (dim 4096, 32 heads, 8 KV heads, ffn 14336, vocab 128,256,
              TorchTitan's own 8B config: RoPE scaling, init) | debug: titan_simple's debugmodel shape (dim 256,
              16 heads, 8 KV heads, ffn 768, vocab 2000), for CPU rehearsals
  TT_LAYERS   number of transformer blocks (default 4)
  TT_FLOAT8   1: float8 tensorwise linears (torchao), the output projection kept in bf16 (as titan_simple does)
  TT_ATTN     sdpa (default): causal F.scaled_dot_product_attention, the kernel titan_simple uses (TorchTitan
              0.3 ships it only as a test backend; its trainer then passes positions for RoPE only) |
              flex: TorchTitan 0.3's production default, FlexAttention with document (block-causal) masking
  TT_ASSETS   folder with tokenizer.json + tokenizer_config.json (TorchTitan's hf_assets_path)
  TT_DATA     folder of the c4_test-format data (JSON lines with "text")
  TT_LR       learning rate (default 1e-5, as titan_simple's speed job)
  TT_GRAPH_INDUCTOR       graph_trainer's --compile.inductor_compilation: full (default: the whole traced
                          graph through Inductor) | regional (TorchTitan's default: only FlexAttention regions)
  TT_GRAPH_MEMORY_POLICY  graph_trainer's SAC policy: eager (default: every second matmul recomputed, the same
                          rule as the FSDP2 path's selective op AC and titan_simple's) | default (save all matmuls)
  TT_CPU=1    run on CPU (gloo): applies the runtime patches below, as /work/shared/peer/run_peer.sh's
              tools/titan_cpu.py does. Without TT_CPU nothing is patched, except torch.distributed.set_timeout
              where the installed torch lacks it (torch 2.13; TorchTitan 0.3.0 calls it), on any device.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import types

import torch
import torch._utils

CPU = os.environ.get("TT_CPU", "0") == "1"
DIMS = os.environ.get("TT_DIMS", "8b")
N_LAYERS = int(os.environ.get("TT_LAYERS", "4"))
FLOAT8 = os.environ.get("TT_FLOAT8", "0") == "1"
ATTN = os.environ.get("TT_ATTN", "sdpa")
ASSETS = os.environ.get("TT_ASSETS", "./tests/assets/tokenizer")
DATA = os.environ.get("TT_DATA", "tests/assets/c4_test")
LR = float(os.environ.get("TT_LR", "1e-5"))
GRAPH_INDUCTOR = os.environ.get("TT_GRAPH_INDUCTOR", "full")
GRAPH_MEMORY_POLICY = os.environ.get("TT_GRAPH_MEMORY_POLICY", "eager")
FLAVOR = "side_by_side"
TT_VERSION = importlib.metadata.version("torchtitan")
TT_MINOR = tuple(int(x) for x in TT_VERSION.split("+")[0].split(".")[:2])


# ------------------------------------------------------------------------------------------ CPU patches
def _patch_for_cpu() -> None:
    """What TorchTitan needs to train on a CPU host (from the peer's tools/titan_cpu.py, sdpa attention only)."""

    def meminfo_total() -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        return 0

    def vm_hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return -1

    def reset_hwm() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    # 1. torch.cuda-style memory calls of TorchTitan's DeviceMemoryMonitor: "memory" becomes peak RSS (VmHWM).
    cpu = torch.cpu
    if not hasattr(cpu, "get_device_name"):
        cpu.get_device_name = lambda device=None: "cpu"
    if not hasattr(cpu, "get_device_properties"):
        cpu.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=meminfo_total())
    if not hasattr(cpu, "memory_stats"):
        cpu.memory_stats = lambda device=None: {"active_bytes.all.peak": vm_hwm(), "reserved_bytes.all.peak": vm_hwm(),
                                                "num_alloc_retries": 0, "num_ooms": 0}
    if not hasattr(cpu, "reset_peak_memory_stats"):
        cpu.reset_peak_memory_stats = lambda device=None: reset_hwm()
    if not hasattr(cpu, "empty_cache"):
        cpu.empty_cache = lambda: None

    # 2. TorchTitan probes the device at import time (torch._utils._get_available_device_type() or "cuda").
    probe = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        torch._utils._get_available_device_type = probe
    assert tt_utils.device_type == "cpu", tt_utils.device_type

    # 3. FSDP2's gradient reduce-scatter with divide factor 1.0 uses PREMUL_SUM, which gloo lacks: plain SUM.
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fsdp_coll

    factors = fsdp_coll._get_gradient_divide_factors

    def sum_only(*args, **kwargs):
        kwargs["force_sum_reduction_for_comms"] = True
        return factors(*args[:5], **kwargs)

    fsdp_coll._get_gradient_divide_factors = sum_only

    # 4. dist.barrier(device_ids=[torch.cpu.current_device()]) passes the string "cpu": drop it.
    import torch.distributed as dist

    barrier = dist.barrier

    def barrier_cpu(*args, **kwargs):
        ids = kwargs.get("device_ids")
        if ids is not None and not all(isinstance(i, int) for i in ids):
            kwargs.pop("device_ids")
        return barrier(*args, **kwargs)

    dist.barrier = barrier_cpu

    # 5. Selective AC saves the CUDA SDPA kernels' outputs, not the CPU one's: add it (else the graph_trainer's
    #    remat pass refuses to recompute it, and FSDP2's SAC would recompute attention on CPU only).
    cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if TT_MINOR < (0, 3):  # 0.2.x: module-level save lists of each parallelize function
        for name in ("torchtitan.models.llama3.infra.parallelize",
                     "torchtitan.experiments.simple_fsdp.llama3.parallelize"):
            importlib.import_module(name)._op_sac_save_list.add(cpu_sdpa)
        # 0.2.x refuses torchao's float8 emulation under torch.compile; titan_simple compiles it on CPU
        import torchtitan.components.quantization.float8 as tt_float8

        tt_float8.has_cuda_capability = lambda major, minor: True
        return
    import torchtitan.distributed.activation_checkpoint as tt_ac

    if hasattr(tt_ac, "_get_default_save_ops"):
        save_ops = tt_ac._get_default_save_ops

        def with_cpu_sdpa():
            ops = save_ops()
            op = cpu_sdpa
            if isinstance(ops, dict):
                from torch.utils.checkpoint import CheckpointPolicy

                ops[op] = CheckpointPolicy.MUST_SAVE
            else:
                ops.add(op)
            return ops

        tt_ac._get_default_save_ops = with_cpu_sdpa


def _patch_torch_version_gaps() -> None:
    """TorchTitan 0.3.0 calls torch.distributed.set_timeout, which torch 2.13 does not have (0.3.0 was cut against
    torch 2.14 nightlies); 2.13 has the same operation as distributed_c10d._set_pg_timeout."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


# ----------------------------------------------------------------------------------- TorchTitan 0.3.x
def _register_flavor_03() -> None:
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention

    def build(attn_backend: str = "flex", tp_gemm_backend: str = "default"):
        backend = "flex" if attn_backend == "sdpa" else attn_backend
        if DIMS == "8b":
            config = llama3.llama3_configs["8B"](attn_backend=backend, tp_gemm_backend=tp_gemm_backend)
            config.layers = config.layers[:N_LAYERS]
        else:  # titan_simple's debugmodel: dim 256, 16 heads, 8 KV heads, ffn 768, vocab 2000
            config = llama3.llama3_configs["debugmodel"](attn_backend=backend, tp_gemm_backend=tp_gemm_backend)
            dim, heads, vocab = 256, 16, 2000
            config.layers = llama3._build_llama3_layers(
                n_layers=N_LAYERS, dim=dim, n_heads=heads, n_kv_heads=8,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000, scaling="llama"),
                attn_backend=backend, tp_gemm_backend=tp_gemm_backend)
            config.vocab_size = vocab
            config.tok_embeddings.num_embeddings = vocab
            config.lm_head.out_features = vocab
        if attn_backend == "sdpa":  # as graph_trainer's build_decoder_config_for_backend does for its tests
            for layer in config.layers:
                layer.attention.inner_attention = ScaledDotProductAttention.Config()
        return config

    llama3.llama3_configs[FLAVOR] = build


def _base_config_03():
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_8b
    from torchtitan.tools.profiler import Profiler

    converters = None
    if FLOAT8:
        from torchtitan.components.quantization import Float8LinearConverter

        if CPU:  # no float8 matmuls on CPU: torchao's emulation (tensorwise scaling), which TorchTitan
            # accepts only with model_compile_enabled=False (the flag only gates this check)
            converters = [Float8LinearConverter.Config(emulate=True, filter_fqns=["lm_head"],
                                                       model_compile_enabled=False)]
        else:  # 0.3 types recipe_name as rowwise-only; torchao's from_recipe_name takes "tensorwise"
            converters = [Float8LinearConverter.Config(recipe_name="tensorwise", filter_fqns=["lm_head"],
                                                       model_compile_enabled=True)]
    config = llama3_8b()  # TorchTitan's 8B recipe: selective op AC, AdamW, chunked loss ...
    config.model_spec = model_registry(FLAVOR, attn_backend=ATTN, converters=converters)
    config.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec)))
    config.hf_assets_path = ASSETS
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=DATA)
    config.profiler = Profiler.Config()
    config.metrics = MetricsProcessor.Config(log_freq=1, enable_tensorboard=False)
    config.optimizer = default_adamw(lr=LR)
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear", min_lr_factor=0.0)
    config.compile = CompileConfig(enable=True, components=["model", "loss"])
    # FSDP2 on SPMD-typed parameters (0.3's default backend) needs a newer torch than 2.13; the graph_trainer
    # switches to partial_dtensor itself.
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def _configs_module_03() -> str:
    module = types.ModuleType("titan_side_by_side_configs")

    def fsdp2():
        return _base_config_03()

    def simplefsdp():
        from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig, to_graph_trainer_config
        from torchtitan.experiments.graph_trainer.llama3 import model_registry as graph_registry

        config = to_graph_trainer_config(_base_config_03(), graph_registry)
        disable = ["joint_transformer_block_bucketing_reordering_pass", "cudagraph_pass"] if CPU else []
        config.compile = GraphTrainerCompileConfig(enable=True, inductor_compilation=GRAPH_INDUCTOR,
                                                   memory_policy=GRAPH_MEMORY_POLICY, disable_passes=disable)
        return config

    module.fsdp2, module.simplefsdp = fsdp2, simplefsdp
    sys.modules[module.__name__] = module
    return module.__name__


def main_03(mode: str, rest: list[str]) -> None:
    _register_flavor_03()
    sys.argv = [sys.argv[0], "--module", _configs_module_03(), "--config", mode, *rest]
    from torchtitan.train import main

    main()


# ----------------------------------------------------------------------------------- TorchTitan 0.2.x
def argv_02(mode: str, rest: list[str]) -> list[str]:
    """0.2.x's ConfigManager.parse_args binds sys.argv[1:] as a default at import: set sys.argv before any import."""
    args = ["--model.name", "llama3" if mode == "fsdp2" else "simple_fsdp.llama3", "--model.flavor", FLAVOR,
            "--model.hf_assets_path", ASSETS, "--training.dataset", "c4_test", "--training.dataset_path", DATA,
            "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
            "--compile.enable", "--compile.components", "model,loss", "--metrics.log_freq", "1",
            "--optimizer.lr", str(LR), "--lr_scheduler.warmup_steps", "2"]
    if mode == "simplefsdp":  # the experiment's own config section (compile.graph_passes), as its tests pass it
        args += ["--job.custom_config_module", "torchtitan.experiments.simple_fsdp.job_config"]
    if FLOAT8:
        args += ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "tensorwise",
                 "--quantize.linear.float8.filter_fqns", "output"]
        if CPU:
            args += ["--quantize.linear.float8.emulate"]
    return [sys.argv[0], *args, *rest]


def main_02() -> None:
    import dataclasses

    from torchtitan.models.llama3 import llama3_args

    if DIMS == "8b":
        llama3_args[FLAVOR] = dataclasses.replace(llama3_args["8B"], n_layers=N_LAYERS)  # sdpa, causal
    else:
        llama3_args[FLAVOR] = dataclasses.replace(llama3_args["debugmodel"], n_layers=N_LAYERS, n_kv_heads=8,
                                                  vocab_size=2000)
    if ATTN == "flex":
        llama3_args[FLAVOR] = dataclasses.replace(llama3_args[FLAVOR], attn_type="flex", attn_mask_type="block_causal")
    from torchtitan.train import Trainer, main

    main(Trainer)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("fsdp2", "simplefsdp"):
        sys.exit(__doc__)
    mode, rest = sys.argv[1], sys.argv[2:]
    if TT_MINOR < (0, 3):
        sys.argv = argv_02(mode, rest)
    if CPU:
        if ATTN != "sdpa":
            sys.exit("torchtitan_launch: on CPU only TT_ATTN=sdpa runs (FlexAttention has no CPU backward)")
        _patch_for_cpu()
    _patch_torch_version_gaps()
    if TT_MINOR >= (0, 3):
        main_03(mode, rest)
    else:
        main_02()
