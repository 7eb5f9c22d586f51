"""The run plan: what a config means for this run, decided once, before any process group exists.

    plan = resolve_plan(config, world_size, device_type="cuda")   # raises the one-line ConfigError
    for line in plan.describe():                                  # what will run, and why where auto chose
        logger.info(line)
    run = build_run(plan, device)                                 # the build, the step, validation, the dry
                                                                  # run and the benchmark read the plan

Every decision derived from the config and the mesh degrees has one function below, and only ``resolve_plan``
calls them (tests may call them directly): the mesh degrees, the pipeline plan, gradient accumulation, the gather
mode, the dtypes and autocast, reshard after forward, loss parallel, the compile mode, attention, the data order
and the stages. Every check that needs no communication runs while resolving. Nothing below the plan
reads ``[parallelism]``, ``[compile]``, ``[activation_checkpoint]``, the precision or attention keys to decide
something again; plain settings (learning rate, paths, intervals) are read from ``plan.config`` where they are used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from titan_simple.compile.compile_plan import CompilePlan
from titan_simple.config import JobConfig, resolve_project_path
from titan_simple.core.batching import DataOrder, accumulation_steps
from titan_simple.core.compile_fingerprint import compile_cache_folder, compile_fingerprint
from titan_simple.core.loss import LossPlan
from titan_simple.core.muon import MuonPlan, plan_optimizer
from titan_simple.core.stages import StagePlan, longest_seq_len, plan_stages
from titan_simple.data.datasets import data_cache_folder
from titan_simple.data.tokenizer import Tokenizer
from titan_simple.errors import ConfigError
from titan_simple.models.attention import AttentionPlan, check_attention_kernel
from titan_simple.models.float8 import Float8Plan, plan_float8, plan_float8_parallel
from titan_simple.models.from_config import check_initial_weights, model_args_for
from titan_simple.models.llama3 import ModelArgs
from titan_simple.parallel.dims import ParallelDims, validate_parallelism
from titan_simple.parallel.parallelize import ParallelPlan
from titan_simple.parallel.pipeline import ZERO_BUBBLE_SCHEDULES, PipelinePlan, plan_pipeline
from titan_simple.parallel.tensor_parallel import local_linear_shape

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype  # what the weights are gathered and computed in
    reduce_dtype: torch.dtype  # what gradients are reduced in across ranks
    autocast_dtype: torch.dtype | None  # set when nobody else casts the weights (no data parallel, bf16)


@dataclass(frozen=True)
class ValidationPlan:
    local_batch_size: int
    seq_len: int


@dataclass(frozen=True)
class RunPlan:
    config: JobConfig  # the settings nothing derives a decision from are read here where they are used
    dims: ParallelDims
    device_type: str  # the device the dtypes were chosen for (cpu or cuda)
    model_args: ModelArgs  # the flavor, its RoPE table as long as [training] seq_len
    pipeline: PipelinePlan | None
    accumulation_steps: int  # microbatches of local_batch_size per step on each dp rank
    precision: Precision
    fsdp_gather: str  # per_microbatch | once_per_step (SimpleFSDP under pipeline parallel / accumulation)
    parallel: ParallelPlan  # what the recipe applies (tensor parallel, AC, data parallel, compile)
    loss: LossPlan
    data: DataOrder
    validation: ValidationPlan | None
    float8: Float8Plan | None = None  # [model] converters = ["float8"]
    attention: AttentionPlan = AttentionPlan()  # the kernel and the mask (causal or block-causal)
    muon: MuonPlan | None = None  # [optimizer] name = "Muon": which parameters take it
    stages: StagePlan | None = None  # [[training.stages]]: each step's batch, seq_len and mixture (core/stages.py)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # why "auto" / "default" chose

    @property
    def compile(self) -> CompilePlan:
        return self.parallel.compile

    @property
    def global_tokens(self) -> int:
        return self.data.global_rows * self.config.training.seq_len

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast: only without data parallel in bf16 (data parallel casts the weights)."""
        if self.precision.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.precision.autocast_dtype)

    def without_compile(self) -> RunPlan:
        """The same plan run eagerly (the dry run traces it; ``loss.compiled_with_model`` keeps what the real
        step would compile)."""
        return dataclasses.replace(
            self, parallel=dataclasses.replace(self.parallel, compile=dataclasses.replace(self.compile, mode="off")))

    def describe(self) -> list[str]:
        """The plan in at most 8 lines (and the stages' table): what will run, and why where ``auto`` chose."""
        config, dims, parallel = self.config, self.dims, self.parallel
        args, training = self.model_args, config.training

        def why(key: str) -> str:
            return f" ({self.reasons[key]})" if key in self.reasons else ""

        model = config.model.flavor if not config.model.hf_config else f"from {config.model.hf_config}"
        rope = f", RoPE scaled {args.rope_scaling.factor:g}x" if args.rope_scaling is not None else ""
        tied = ", tied embeddings" if args.tie_word_embeddings else ""
        lines = [f"plan: llama3 {model} ({args.n_layers} layers, dim {args.dim}, vocab {args.vocab_size}{rope}{tied}) "
                 f"| world {dims.world_size} on {self.device_type}: {dims.describe}"]
        if dims.wraps_data_parallel:
            wrapper = "SimpleFSDP" if parallel.fsdp_implementation == "simple" else "FSDP2"
            reshard = "reshard after forward" if parallel.reshard_after_forward else "keep gathered weights"
            gather = f" | gather {self.fsdp_gather}{why('gather')}" if parallel.fsdp_implementation == "simple" else ""
            mode = dims.data_parallel_mode + (" over dp_shard x cp" if dims.cp > 1 else "")
            lines.append(f"  data parallel: {wrapper} {mode}, {reshard}{why('reshard')}{gather}")
        precision = self.precision
        autocast = (f"autocast {_name(precision.autocast_dtype)}" if precision.autocast_dtype is not None
                    else "no autocast")
        float8 = "" if self.float8 is None else f" | {self.float8.describe()}"
        ignored = sorted(key for key in config.sources if key.startswith("float8."))
        if self.float8 is None and ignored:  # [float8] keys do nothing without the converter: say so, once
            float8 = f" | {', '.join(ignored)} ignored: [model] converters has no float8"
        lines.append(f"  precision: {_name(precision.param_dtype)} compute{why('dtype')}, "
                     f"{_name(precision.reduce_dtype)} reduce, {autocast}{float8}")
        shuffle = (f"shuffled (seed {self.data.shuffle_seed})" if self.data.shuffle_seed is not None
                   else "in store order")
        lines.append(f"  batch: {self.data.global_rows} x {training.seq_len} = {self.global_tokens:,} tokens per "
                     f"step | local {training.local_batch_size} x {self.accumulation_steps} accumulation | data "
                     f"{shuffle}" + (f" | {self.attention.describe()}" if self.attention != AttentionPlan() else ""))
        if self.pipeline is not None:
            plan = self.pipeline
            fewest, most = min(map(len, plan.stage_layers)), max(map(len, plan.stage_layers))
            layers = str(most) if fewest == most else f"{fewest}-{most}"
            lines.append(f"  pipeline: {plan.schedule}, {plan.num_stages} stages of {layers} layers "
                         f"({plan.num_stages // plan.pp} per pp rank), {plan.n_microbatches} microbatches")
        ac = parallel.ac_mode + (f" ({parallel.ac_option})" if parallel.ac_mode == "selective" else "")
        loss = "loss parallel" if self.loss.parallel else "cross-entropy"
        chunks = f" in {self.loss.chunks} chunks" if self.loss.chunks > 1 else ""
        lines.append(f"  activation checkpointing: {ac} | loss: {loss}{chunks}"
                     + (f", compiled with the model{why('loss')}" if self.loss.compiled_with_model else ""))
        lines.append(f"  {self._describe_compile(why('compile'))}")
        if self.validation is not None:
            lines.append(f"  validation: every {config.validation.freq} steps, {self.validation.local_batch_size} x "
                         f"{self.validation.seq_len} per dp rank")
        if self.muon is not None:
            lines.append(f"  {self.muon.describe()}")
        if self.stages is not None:  # the table, a line per stage
            lines += self.stages.describe([source.name for source in training.mixture])
        return lines

    def _describe_compile(self, why: str) -> str:
        compile_plan = self.compile
        if not compile_plan.enabled:
            return "compile: off (eager)"
        what = {"whole": "whole model / stage", "whole_with_loss": "model + loss as one graph",
                "per_block": "each transformer block",
                "regional": f"regional, one code for every region of {compile_plan.region_blocks} "
                            f"transformer block{'s' * (compile_plan.region_blocks > 1)}"}[compile_plan.mode]
        passes = (f", bucketing {compile_plan.bucketing}, reorder {'on' if compile_plan.reorder else 'off'}"
                  if compile_plan.mode != "per_block" and compile_plan.backend == "inductor" else "")
        async_tp = ", async TP" if compile_plan.async_tensor_parallel else ""
        return f"compile: {what}{why}, {compile_plan.backend}{passes}{async_tp}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- resolving


def resolve_plan(config: JobConfig, world_size: int, device_type: str) -> RunPlan:
    """Decide everything the config leaves to the layout, for ``world_size`` processes on ``device_type`` (``cpu``
    or ``cuda``: it decides ``auto`` dtypes). Raises the one-line ConfigError of any no-communication check."""
    reasons: dict[str, str] = {}
    dims = ParallelDims.from_config(config, world_size)
    attention = plan_attention(config, dims, device_type)
    model_args = model_args_for(config, max_seq_len=longest_seq_len(config))
    validate_parallelism(dims, model_args, config)
    check_initial_weights(config, model_args)
    check_profiling(config, world_size, device_type)
    float8 = plan_float8(config.model.converters, config.float8, model_args, device_type, config.dry_run.enable,
                         local_shape=local_linear_shape(dims.tp) if dims.tp > 1 else None)
    pipeline = plan_pipeline(config, model_args.n_layers, dims.pp) if dims.pp > 1 else None
    data = _data_order(config, dims)
    accumulation = accumulation_steps(config.training.global_batch_size, config.training.local_batch_size,
                                      data.ranks)
    gather = choose_fsdp_gather(config, dims, reasons)
    float8 = plan_float8_parallel(float8, config.float8.all_gather, dims, config.parallelism.fsdp_implementation)
    precision = choose_precision(config, dims, device_type, reasons)
    compile_mode = choose_compile_mode(config, dims, reasons)
    compile_plan = _compile_plan(config, dims, compile_mode, gather, float8,
                                 async_tp=choose_async_tensor_parallel(config, dims, device_type))
    loss_parallel = uses_loss_parallel(config, dims)
    ac = config.activation_checkpoint
    parallel = ParallelPlan(
        dims=dims, loss_parallel=loss_parallel, ac_mode=ac.mode, ac_option=ac.selective_ac_option,
        fsdp_implementation=config.parallelism.fsdp_implementation, param_dtype=precision.param_dtype,
        reduce_dtype=precision.reduce_dtype,
        reshard_after_forward=choose_reshard_after_forward(config, dims, gather, reasons), compile=compile_plan,
        float8_all_gather=float8 is not None and float8.all_gather,
        float8_tensor_parallel=float8 is not None and float8.tensor_parallel,
        save_float8_amax=config.float8.stable_recompute,
    )
    loss = LossPlan(parallel=loss_parallel, compiled_with_model=compile_mode == "whole_with_loss",
                    chunks=choose_loss_chunks(config, compile_mode, reasons))
    if compile_plan.enabled:
        fingerprint, parts = compile_fingerprint(config, model_args, parallel, loss, pipeline, accumulation, float8,
                                                 attention, device_type)
        parallel = dataclasses.replace(parallel, compile=dataclasses.replace(compile_plan, fingerprint=fingerprint,
                                                                             fingerprint_parts=parts))
    data = dataclasses.replace(data, global_rows=config.training.local_batch_size * data.ranks * accumulation)
    return RunPlan(
        config=config, dims=dims, device_type=device_type, model_args=model_args, pipeline=pipeline,
        accumulation_steps=accumulation, precision=precision, fsdp_gather=gather, parallel=parallel, loss=loss,
        data=data, validation=plan_validation(config, dims, pipeline), float8=float8, attention=attention,
        muon=plan_optimizer(config, model_args), reasons=reasons,
        stages=plan_stages(config, dims, model_args, data.ranks),
    )



def plan_attention(config: JobConfig, dims: ParallelDims, device_type: str) -> AttentionPlan:
    """``[model] attention`` and ``attention_mask`` (``models/attention.py``), and what context parallel needs of
    them; block-causal finds documents by the tokenizer's EOS, which a dry run does not read (it prices the mask
    as causal)."""
    model, eos_id = config.model, None
    check_attention_kernel(model.attention, device_type, dims.cp)
    if dims.cp > 1 and config.parallelism.fsdp_implementation != "simple":
        raise ConfigError(f"[parallelism] context_parallel_degree = {dims.cp} needs fsdp_implementation = 'simple': "
                          "SimpleFSDP shards the weights over dp_shard x cp and sums their gradients; use it.")
    try:
        if model.attention_mask == "block_causal" and not config.dry_run.enable:
            eos_id = Tokenizer(resolve_project_path(model.tokenizer_path)).eos_id
    except ConfigError as error:
        raise ConfigError(f"[model] attention_mask = 'block_causal' needs the tokenizer's EOS: {error}") from None
    return AttentionPlan(kernel=model.attention, mask=model.attention_mask, eos_id=eos_id)


def _data_order(config: JobConfig, dims: ParallelDims) -> DataOrder:
    """Who reads which rows (``global_rows`` is set once the accumulation is known). With fault tolerance the
    global batch spans every replica group: each group's dp ranks read their block of it."""
    ft, training = config.fault_tolerance, config.training
    return DataOrder(global_rows=0, shuffle_seed=training.seed if training.shuffle else None,
                     cache=data_cache_folder(training.data_cache),
                     ranks=dims.dp * (ft.group_size if ft.enable else 1),
                     first_rank=ft.replica_id * dims.dp if ft.enable else 0)


def _compile_plan(config: JobConfig, dims: ParallelDims, compile_mode: str, gather: str, float8: Float8Plan | None,
                  *, async_tp: bool) -> CompilePlan:
    """The ``[compile]`` settings as the mode chosen for this layout runs them."""
    compile_config = config.compile
    return CompilePlan(
        mode=compile_mode, backend=compile_config.backend, bucketing=compile_config.bucketing,
        manual_plan=tuple(p if isinstance(p, str) else tuple(p) for p in compile_config.manual_bucketed_modules),
        reorder=compile_config.reorder, dump_folder=config.job.dump_folder,
        region_blocks=compile_config.regional_blocks if compile_mode == "regional" else 1,
        # Each region gathers the next one's first weights (compile/regions.py): only where SimpleFSDP gathers
        # them per microbatch (gathering once per step holds every weight already), the regions are one model
        # (a pipeline stage's last region has no next one on its rank) and the collectives are reordered
        # (without, the hand-off would hold weights and hide nothing).
        region_handoff=(compile_mode == "regional" and dims.wraps_data_parallel and dims.pp == 1
                        and gather == "per_microbatch"
                        and (compile_config.reorder or compile_config.bucketing == "auto")),
        async_tensor_parallel=async_tp,
        cache_dir=compile_cache_folder(config),
        # Rowwise float8 rounds each scale to a power of two: a value Inductor recomputes in backward (selective
        # AC) without the eager casts' rounding can flip a scale and the cast after it (TorchTitan sets it for
        # rowwise too; pytorch#150859: rowwise + compile + selective AC stalled, then NaN, on 8B).
        emulate_precision_casts=(float8 is not None and float8.recipe.startswith("rowwise")
                                 and config.float8.stable_recompute),
        once=compile_config.compile_on_one_rank and dims.world_size > 1 and compile_config.backend == "inductor",
    )


def check_profiling(config: JobConfig, world_size: int, device_type: str) -> None:
    """A CPU memory timeline (``trainer/profiling.py``) needs a single process: gloo's threads free what a
    collective holds outside the profiler's view, and torch 2.13's ``export_memory_timeline`` then fails (2 ranks of
    the debug model: 15-27 such frees per step, every export failed). CUDA snapshots work on any layout."""
    if config.profiling.enable_memory_snapshot and device_type == "cpu" and world_size > 1:
        raise ConfigError(
            f"[profiling] enable_memory_snapshot on CPU needs one process, not {world_size}: torch 2.13's CPU "
            "memory timeline misses the frees made on gloo's threads and cannot be built. Run it with one process "
            "(python train.py ...), use --dry_run for this layout's memory per rank, or drop the option (traces "
            "still work)."
        )


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX): Linux's CPU flags, the same answer on
    every rank of a machine. Without them bf16 runs slower than fp32 on CPU (measurements: docs/benchmarks.md)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def choose_precision(config: JobConfig, dims: ParallelDims, device_type: str,
                     reasons: dict[str, str] | None = None) -> Precision:
    """``mixed_precision_param = auto``: bf16 on GPUs and on CPUs with native bf16 (``cpu_has_native_bf16``);
    fp32 on other CPUs, where bf16 is emulated and slower than fp32. Without data parallel no wrapper casts the
    weights, so a bf16 forward runs under autocast."""
    training = config.training
    name = training.mixed_precision_param
    if name == "auto":
        if device_type == "cuda":
            param_dtype, why = torch.bfloat16, "auto: GPU"
        elif device_type == "cpu" and cpu_has_native_bf16():
            param_dtype, why = torch.bfloat16, "auto: this CPU has native bf16"
        else:
            param_dtype, why = torch.float32, "auto: this CPU emulates bf16, slower than fp32"
        if reasons is not None:
            reasons["dtype"] = why
    else:
        param_dtype = DTYPES[name]
    autocast = param_dtype if not dims.wraps_data_parallel and param_dtype != torch.float32 else None
    return Precision(param_dtype=param_dtype, reduce_dtype=DTYPES[training.mixed_precision_reduce],
                     autocast_dtype=autocast)


def choose_fsdp_gather(config: JobConfig, dims: ParallelDims, reasons: dict[str, str] | None = None) -> str:
    """``per_microbatch`` or ``once_per_step`` (``[parallelism] fsdp_gather``, ``parallel/fsdp_gather.py``).
    ``auto``: once per step under pipeline parallel with sharded weights (a stage's weights are a fraction of
    the model: far fewer all-gathers, docs/dry_run.md); per microbatch otherwise,
    where holding the unsharded model would give up what sharding saves. Raises the ConfigError of a layout
    that cannot gather once per step."""
    parallelism = config.parallelism
    choice = parallelism.fsdp_gather
    if not dims.wraps_data_parallel or parallelism.fsdp_implementation != "simple":
        if choice == "once_per_step":
            raise ConfigError(
                "[parallelism] fsdp_gather = 'once_per_step' needs SimpleFSDP with data parallel "
                "(fsdp_implementation = 'simple' and a dp degree > 1); FSDP2 under pipeline parallel already "
                "reduces once per step. Use fsdp_gather = 'auto'."
            )
        return "per_microbatch"
    schedule = parallelism.pipeline_parallel_schedule
    if dims.pp > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        if choice == "once_per_step":
            raise ConfigError(
                f"[parallelism] fsdp_gather = 'once_per_step' does not work with pipeline_parallel_schedule = "
                f"{schedule!r} (its split backward computes weight gradients of the stored parameters, not of "
                "held weights); use fsdp_gather = 'auto' or another schedule."
            )
        if choice == "auto" and reasons is not None:
            reasons["gather"] = "auto: zero-bubble schedule"
        return "per_microbatch"
    if choice != "auto":
        return choice
    sharded = dims.data_parallel_mode != "replicate"
    mode = "once_per_step" if dims.pp > 1 and sharded else "per_microbatch"
    if reasons is not None:
        reasons["gather"] = ("auto: a pp rank holds one stage" if mode == "once_per_step"
                             else "auto: " + ("replicated weights" if dims.pp > 1 else "no pipeline"))
    return mode


def choose_reshard_after_forward(config: JobConfig, dims: ParallelDims, fsdp_gather: str,
                                 reasons: dict[str, str] | None = None) -> bool:
    """``fsdp_reshard_after_forward``; ``default``: reshard except under pipeline parallel."""
    if fsdp_gather == "once_per_step":
        if reasons is not None:
            reasons["reshard"] = "held for the whole step"
        return False  # the weights are held for the whole step: there is nothing to free after forward
    choice = config.parallelism.fsdp_reshard_after_forward
    if choice == "default":
        # Under PP, resharding would add a second all-gather per microbatch (in its backward) to the one
        # every microbatch forward already does: SimpleFSDP gathers inside each forward, so it gathers once
        # per microbatch, not once per step as FSDP2 does (see docs/dry_run.md: 16x FSDP2's all-gather
        # traffic for the 405B config). Keeping the gathered weights for backward halves that.
        if reasons is not None:
            reasons["reshard"] = "default: " + ("pipeline parallel" if dims.pp > 1 else "no pipeline")
        return dims.pp == 1
    return choice == "always"


def uses_loss_parallel(config: JobConfig, dims: ParallelDims) -> bool:
    """Whether the model returns vocab-sharded logits, so the loss (and its backward) must run under
    ``tensor_parallel.loss_parallel_context(True)``."""
    return dims.tp > 1 and not config.parallelism.disable_loss_parallel


def choose_compile_mode(config: JobConfig, dims: ParallelDims, reasons: dict[str, str] | None = None) -> str:
    """``off``, ``per_block``, ``regional``, ``whole`` or ``whole_with_loss`` (``compile/compile_plan.CompilePlan``).

    Each transformer block compiles on its own with FSDP2, whose hooks break a whole-model graph (fullgraph
    fails in torch 2.13); and under the zero-bubble pipeline schedules, whose split backward gives wrong weight
    gradients through a whole compiled stage (some are 0). Tensor parallel inside pipeline stages
    compiles whole with every other schedule: a rank running several stages failed to until each rank used one
    ``tp`` mesh object (``dims.tensor_parallel_mesh``; docs/research/repro/repro_tp_pp_whole_stage_compile.py).
    ``[compile] regional`` asks for one compiled code for every region of ``regional_blocks`` blocks (SimpleFSDP
    layouts that would compile whole; the loss then runs eagerly).
    The loss compiles with the model (one graph: Inductor fuses the fp32 cross-entropy) without pipeline
    parallel (the schedule calls the loss) and tensor parallel (the loss runs on DTensors under loss_parallel).
    """
    compile_config, parallelism = config.compile, config.parallelism
    if not compile_config.enable:
        return "off"
    check_compiles_stay_in_their_stage(dims)
    schedule = parallelism.pipeline_parallel_schedule
    per_block_because = None
    if parallelism.fsdp_implementation != "simple":
        per_block_because = "FSDP2's hooks break a whole-model graph"
    elif dims.pp > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        per_block_because = f"{schedule} splits the backward"
    if per_block_because is not None:
        if reasons is not None:
            reasons["compile"] = per_block_because
        defaults = type(compile_config)()
        if (compile_config.bucketing, compile_config.reorder) != (defaults.bucketing, defaults.reorder):
            logger.warning(
                "[compile] bucketing = %r, reorder = %s ignored: this layout compiles each transformer block on "
                "its own (FSDP2 or a zero-bubble schedule), so there is "
                "no whole-step graph to bucket or reorder.", compile_config.bucketing, compile_config.reorder,
            )
        return "per_block"
    if compile_config.regional:
        return "regional"
    return "whole_with_loss" if dims.pp == 1 and dims.tp == 1 else "whole"


def check_compiles_stay_in_their_stage(dims: ParallelDims) -> None:
    """Pipeline stages compile one after another while the other stages wait in a receive, so a compile must not
    run collectives over all ranks. The settings that make it do so (an environment variable or torch config a user
    set; ``compile/inductor_private.cross_rank_compile_settings``) stop the run here instead of deadlocking it.
    Called for compiled runs only: it imports the compiler."""
    from titan_simple.compile.inductor_private import cross_rank_compile_settings

    if dims.pp > 1 and (settings := cross_rank_compile_settings()):
        raise ConfigError(
            f"[compile] enable under pipeline parallel: {', '.join(settings)} makes every compile run collectives "
            "over all ranks, which deadlocks pipeline stages (they compile one after another); turn it off."
        )


def choose_async_tensor_parallel(config: JobConfig, dims: ParallelDims, device_type: str) -> bool:
    """``[parallelism] enable_async_tensor_parallel``, or the one-line error of a run it cannot apply to: it is an
    Inductor pass over compiled graphs (the inductor backend), it fuses tensor-parallel collectives (tp > 1), and
    its fused kernels run on symmetric memory over NCCL (CUDA). On a CPU the pass would match the patterns and
    then fuse nothing, so a CPU run says so instead of pretending."""
    if not config.parallelism.enable_async_tensor_parallel:
        return False
    missing = []
    if dims.tp == 1:
        missing.append("tensor_parallel_degree > 1")
    if not config.compile.enable or config.compile.backend != "inductor":
        missing.append("[compile] enable = true with backend = 'inductor'")
    if device_type != "cuda":
        missing.append(f"NVIDIA GPUs (this run is on {device_type})")
    if missing:
        raise ConfigError(
            "[parallelism] enable_async_tensor_parallel = true needs " + " and ".join(missing)
            + "; set it to false."
        )
    return True


def choose_loss_chunks(config: JobConfig, compile_mode: str, reasons: dict[str, str] | None = None) -> int:
    """``[training] loss_chunks`` where the loss runs eagerly (including tensor-parallel and last-stage losses
    next to a compiled model); 1 where the step compiles the loss with the model: Inductor's fused cross-entropy
    already keeps no fp32 copy of the logits, and the chunks there only cost (docs/benchmarks.md)."""
    chunks = config.training.loss_chunks
    if compile_mode == "whole_with_loss" and chunks > 1:
        if reasons is not None:
            reasons["loss"] = "fused by Inductor, loss_chunks not needed"
        return 1
    return chunks


def plan_validation(config: JobConfig, dims: ParallelDims, pipeline: PipelinePlan | None) -> ValidationPlan | None:
    """``[validation]``'s batch shape (-1: as ``[training]``), checked against the layout; None when off."""
    validation, training = config.validation, config.training
    if not validation.enable:
        return None
    local_batch = training.local_batch_size if validation.local_batch_size == -1 else validation.local_batch_size
    seq_len = training.seq_len if validation.seq_len == -1 else validation.seq_len
    split = dims.tp * (2 * dims.cp if dims.cp > 1 else 1)
    if seq_len % split:
        raise ConfigError(
            f"[validation] seq_len = {seq_len} is not a multiple of {split} ([parallelism] tensor_parallel_degree "
            f"{'x 2 x context_parallel_degree ' if dims.cp > 1 else ''}= {split}); every sequence is split evenly."
        )
    if pipeline is not None and local_batch % pipeline.n_microbatches:
        raise ConfigError(
            f"[validation] local_batch_size = {local_batch} must be a multiple of the pipeline's "
            f"{pipeline.n_microbatches} microbatches ([training] local_batch_size / "
            f"[parallelism] pipeline_parallel_microbatch_size)."
        )
    return ValidationPlan(local_batch_size=local_batch, seq_len=seq_len)
