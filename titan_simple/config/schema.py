"""The job configuration's schema: one dataclass per TOML section, every field with its default and help text
(``python train.py --help`` prints them: this file is the reference manual), and ``JobConfig`` holding them all.
Loading, command-line overrides and validation are ``config/loading.py``'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its documentation (and, for strings, the allowed values)."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Job:
    dump_folder: str = option(
        "./outputs", "Folder for everything a run writes: metrics, TensorBoard, W&B, checkpoints."
    )
    description: str = option("", "Free text describing the run, printed at start-up.")


@dataclass
class Model:
    name: str = option("llama3", "Model family.", choices=("llama3",))
    flavor: str = option(
        "debugmodel", "Model size: debugmodel, debugmodel_large, debugmodel_tied (the debug model shaped like Llama "
        "3.2: tied embeddings, RoPE scaled 32x), Llama 3.2's 1B or 3B, Llama 3.1's 8B, 70B or 405B (RoPE scaled 8x, "
        "as Meta publishes them). Ignored when hf_config is set."
    )
    hf_config: str = option(
        "", "A Hugging Face Llama folder (or its config.json) to build the model from instead of a flavor: its shapes, "
        "RoPE (theta, scaling), norm epsilon and tied embeddings, so any Llama 3 architecture checkpoint loads "
        "(with [checkpoint] initial_load_path = the same folder) without writing a flavor."
    )
    rope_scaling: str = option(
        "default", "RoPE frequency scaling: default (the flavor's or hf_config's) or none (Llama 3.0's plain RoPE, for "
        "runs and checkpoints made before the 8B/70B/405B flavors became Llama 3.1's).", choices=("default", "none")
    )
    n_layers: int = option(
        0, "Transformer blocks, overriding the flavor's (0 = the flavor's): for depth experiments such as "
        "compile time against depth (scripts/benchmarks/benchmark_compile.py)."
    )
    attention: str = option(
        "sdpa", "The attention kernel: sdpa (torch's scaled_dot_product_attention, both masks: causal runs flash; a "
        "block-causal mask is a dense boolean tensor, given to CPU's flash kernel and CUDA's memory-efficient one) "
        "or flex (FlexAttention, compiled, a block-sparse mask; CUDA only: torch 2.13's FlexAttention has no "
        "backward on CPU).",
        choices=("sdpa", "flex"),
    )
    attention_mask: str = option(
        "causal", "causal (every earlier token of the sequence) or block_causal (document masking, as Llama 3 was "
        "pretrained: a token attends only to earlier tokens of its own document inside a packed sequence; documents "
        "end at the tokenizer's EOS). TorchTitan calls it attn_mask_type.", choices=("causal", "block_causal"),
    )
    converters: list[str] = option(
        [], "Module swaps applied to the model on the meta device, before tensor parallel and SimpleFSDP: "
        "'float8' (torchao's float8 linears, configured in [float8]; needs the float8 extra and a GPU with float8 "
        "matmuls, compute capability 8.9+, or a CPU, where torchao emulates the matmuls: numerics only, no speed)."
    )
    tokenizer_path: str = option(
        "assets/tokenizer/shakespeare_bpe_2k.json",
        "A Hugging Face tokenizer.json, or a tiktoken-format tokenizer.model such as Llama 3's "
        "(relative paths: the working directory first, then the project folder).",
    )


@dataclass
class Float8:
    recipe: str = option(
        "tensorwise", "How float8 linears scale: tensorwise (one scale per tensor; the fastest in TorchTitan's H100 "
        "runs), rowwise (one per row: more accurate, its backward's weight gradient in float8 too) or "
        "rowwise_with_gw_hp (rowwise, the weight gradient in high precision).",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    filter_fqns: list[str] = option(
        ["output"], "Linears kept in high precision: a linear whose name contains one of these stays as it is "
        "(default: the output projection, whose accuracy the loss feels most). Linears whose dimensions are not "
        "multiples of 16 (float8 matmuls need them) stay too; the plan line counts both."
    )
    all_gather: bool = option(
        True, "Tensorwise only: SimpleFSDP casts each weight shard to float8 before all-gathering it, so the gather "
        "moves 1 byte per element instead of bf16's 2 (one all-reduce of every weight's amax per step sets the "
        "scales). Same numbers as gathering in bf16. Rowwise and FSDP2 "
        "gather in the param dtype; the plan line says which."
    )
    stable_recompute: bool = option(
        True, "Recomputed float8 casts equal the forward's: selective AC saves each scale's amax and, compiled, "
        "rowwise runs with Inductor's precision-cast emulation (TorchTitan's workaround for rowwise + compile + "
        "selective AC diverging). false turns both off, only to compare (scripts/gpu_session.sh rowwise_probe)."
    )


@dataclass
class Optimizer:
    name: str = option(
        "AdamW", "Optimizer: AdamW (decoupled weight decay), Adam (L2 decay), or Muon: Muon for every 2-D weight of "
        "the transformer blocks (attention q/k/v/o, the MLP's three matrices), AdamW with the keys above for the "
        "rest (embedding, output projection, norms).", choices=("AdamW", "Adam", "Muon"))
    lr: float = option(8e-4, "Peak learning rate (AdamW's, under Muon too).")
    eps: float = option(1e-8, "Adam epsilon.")
    weight_decay: float = option(0.1, "Decoupled weight decay, applied to every parameter.")
    implementation: str = option("foreach", "Kernel style of the optimizer step.", choices=("foreach", "for-loop"))
    muon_lr: float | None = option(
        None, "Muon's peak learning rate; none = lr. With muon_adjust_lr_fn = 'match_rms_adamw' Muon's updates have "
        "AdamW's RMS, so AdamW's tuned lr (and weight_decay) transfer.")
    muon_weight_decay: float | None = option(None, "Muon's decoupled weight decay; none = weight_decay.")
    muon_momentum: float = option(0.95, "Muon's momentum, in [0, 1).")
    muon_nesterov: bool = option(True, "Nesterov momentum for Muon.")
    muon_ns_steps: int = option(5, "Newton-Schulz iterations per orthogonalization (torch.optim.Muon's 5).")
    muon_adjust_lr_fn: str = option(
        "match_rms_adamw", "Muon's learning rate per matrix, as torch.optim.Muon's adjust_lr_fn: 'match_rms_adamw' "
        "(x 0.2 sqrt(max(rows, cols)), Moonshot's) or 'original' (x sqrt(max(1, rows / cols)), Keller Jordan's).",
        choices=("match_rms_adamw", "original"))
    muon_ns_dtype: str = option(
        "bfloat16", "Precision of the Newton-Schulz iterations: bfloat16 (as torch.optim.Muon and published "
        "implementations) or float32 (exactness studies).", choices=("bfloat16", "float32"))
    muon_exclude: list[str] = option(
        [], "Block matrices to leave on AdamW, as name substrings (e.g. 'feed_forward.w2'); the plan names them.")


@dataclass
class LRScheduler:
    warmup_steps: int = option(200, "Steps of linear warmup from ~0 to the peak learning rate.")
    decay_ratio: float | None = option(
        None, "Fraction of all steps spent decaying (WSD when < 1 - warmup share); none = decay after warmup."
    )
    decay_type: str = option(
        "linear", "Shape of the decay.", choices=("linear", "sqrt", "cosine", "constant")
    )
    min_lr_factor: float = option(0.0, "Learning rate at the end of decay, as a fraction of the peak.")


@dataclass
class MixtureSource:
    """One ``[[training.mixture]]`` entry: a source of a weighted mixture (data/mixture.py)."""

    name: str = option("", "The source's name in the logs, metrics.jsonl and TensorBoard (distinct, no spaces).")
    dataset: str = option(
        "auto", "As [training] dataset: built-in 'shakespeare' / 'shakespeare_paragraphs', or local files read "
        "as 'text', 'json', 'parquet' or 'auto' (the format from the extensions).")
    dataset_path: str | None = option(None, "As [training] dataset_path: a file, folder or glob.")
    weight: float = option(
        1.0, "The source's share of the training tokens, relative to the other entries' (0.5, 0.3, 0.2 or 5, 3, 2).")


@dataclass
class TrainingStage:
    """One ``[[training.stages]]`` entry: from a step (or a number of tokens) on, what changes (core/stages.py)."""

    name: str = option("", "The stage's name in the plan's table and the logs (default: stage N).")
    start_step: int = option(-1, "The stage starts after this many steps (its first step is start_step + 1).")
    start_tokens: int = option(
        -1, "Or: the stage starts at the first step boundary where this many training tokens have been consumed.")
    global_batch_size: int = option(
        -1, "Sequences per optimizer step from this stage on (-1: the previous stage's); the layout and the local "
        "batch stay, the accumulation steps follow, so it must be a multiple of local_batch_size x data-parallel "
        "degree.")
    seq_len: int = option(-1, "Tokens per sequence from this stage on (-1: the previous stage's).")
    mixture_weights: dict[str, float] = option(
        {}, "The mixture's weights from this stage on, by source name ({web = 0.3, code = 0.7}; a source not named "
        "keeps its weight, 0 leaves it out); {} keeps the previous stage's.")
    lr_decay: bool = option(
        False, "The learning rate's decay starts at this stage and ends at [training] steps (WSD's decay, Llama "
        "3's annealing); [lr_scheduler] decay_ratio must then be none.")


@dataclass
class Training:
    local_batch_size: int = option(8, "Sequences per data-parallel rank per micro-step.")
    global_batch_size: int = option(
        -1, "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree. "
        "A larger value accumulates gradients over several micro-steps."
    )
    seq_len: int = option(2048, "Tokens per sequence.")
    max_norm: float = option(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    steps: int = option(10000, "Optimizer steps to train.")
    dataset: str = option(
        "shakespeare", "Built-in 'shakespeare' (each play one document) or 'shakespeare_paragraphs' (each paragraph "
        "one: short documents, for block-causal masking), or local files read as 'text', 'json', 'parquet' or "
        "'auto'."
    )
    dataset_path: str | None = option(
        None, "Local file, folder or glob for the dataset (needed unless the dataset is built in). With the "
        "built-in 'shakespeare', a path that is not a folder of its texts is read as your own files, the format "
        "taken from the extensions."
    )
    mixture: list[MixtureSource] = option(
        [], "A weighted mixture of sources instead of dataset / dataset_path: [[training.mixture]] tables, each a "
        "name, dataset, dataset_path and weight (a share of tokens). The blend is deterministic: after any step "
        "each source has given its share of the tokens to within one sequence, and every layout reads the same "
        "samples (data/mixture.py)."
    )
    stages: list[TrainingStage] = option(
        [], "Stages of the run: [[training.stages]] tables, each starting at a step or a number of tokens, that "
        "change the global batch (a ramp), seq_len, the mixture's weights, or start the learning rate's decay. "
        "The plan prints them as a table; the schedule and the data position count tokens (core/stages.py)."
    )
    shuffle: bool = option(
        True, "Visit the documents in a new seeded order every epoch; false = the order of the files and of the "
        "documents in them."
    )
    data_cache: str | None = option(
        None, "Folder of the token stores (each corpus tokenized once, then memory-mapped by every run; "
        "scripts/prepare_data.py builds one ahead). Every rank must see it. Default: "
        "$XDG_CACHE_HOME/titan_simple/token_store, else ~/.cache/titan_simple/token_store."
    )
    seed: int = option(0, "Seed for model init and everything random; same config + seed = same losses on CPU.")
    deterministic: bool = option(False, "Use deterministic algorithms (slower on GPU).")
    skip_nonfinite_steps: bool = option(
        False, "On a NaN/Inf loss or gradient norm, skip that optimizer step (warn) instead of stopping the run."
    )
    mixed_precision_param: str = option(
        "auto", "dtype the weights are gathered and computed in; auto = bfloat16 on GPUs and on CPUs with "
        "native bf16 (AVX512-BF16 / AMX: ~5x faster matmuls), float32 on other CPUs (emulated bf16 is slower).",
        choices=("auto", "bfloat16", "float32"),
    )
    loss_chunks: int = option(
        8, "Compute the cross-entropy this many token chunks at a time: only one chunk's fp32 logits exist at once "
        "and backward keeps just the logits' gradient in their dtype (Llama 3 8B at 8192 tokens: ~12 GiB less "
        "than 1, the plain loss). Same values as 1 to fp32 rounding."
    )
    mixed_precision_reduce: str = option(
        "float32", "dtype gradients are reduced in across ranks.", choices=("float32", "bfloat16")
    )
    expandable_segments: bool = option(
        True, "CUDA: let the caching allocator grow segments in place instead of allocating new blocks "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before CUDA starts): less fragmentation as "
        "activations and gathered weights change size. Left alone when PYTORCH_CUDA_ALLOC_CONF or "
        "PYTORCH_ALLOC_CONF is already set. The dry run's allocator overhead was fitted on runs with it on."
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = option(1, "Replicas (DDP dimension; HSDP when combined with sharding).")
    data_parallel_shard_degree: int = option(-1, "Shards (FSDP dimension); -1 = the rest of the world size.")
    tensor_parallel_degree: int = option(1, "Tensor-parallel degree.")
    context_parallel_degree: int = option(
        1, "Context-parallel degree: the ranks of each data-parallel group split every sequence (head-tail "
        "balanced, 2 x cp chunks), gather the keys and values of the whole sequence in each attention, and shard the "
        "weights with the data-parallel shards (SimpleFSDP over dp_shard x cp). For long sequences: activations "
        "and logits per rank fall by the degree. seq_len must be a multiple of 2 x cp (x tensor_parallel_degree)."
    )
    disable_loss_parallel: bool = option(
        False, "With tensor parallel, all-gather the full logits for the loss instead of computing the "
        "cross-entropy on vocab-sharded logits (loss parallel, the default: less memory and traffic)."
    )
    enable_async_tensor_parallel: bool = option(
        False, "Async tensor parallel (compiled, NVIDIA GPUs): Inductor splits each tensor-parallel all-gather "
        "before a matmul and each reduce-scatter after one into per-rank chunks over symmetric memory, so the "
        "transfer overlaps the matmul instead of waiting for it. Needs [compile] enable with the inductor "
        "backend and tensor_parallel_degree > 1."
    )
    pipeline_parallel_degree: int = option(1, "Pipeline-parallel degree.")
    pipeline_parallel_schedule: str = option(
        "1F1B", "Pipeline schedule. GPipe and 1F1B run 1 stage per pp rank; Interleaved1F1B, LoopedBFS and "
        "InterleavedZeroBubble 2 or more (looped: stage s on rank s % pp); ZBVZeroBubble exactly 2 (V-shaped: "
        "rank r holds stages r and 2 pp - 1 - r).",
        choices=("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"),
    )
    pipeline_parallel_microbatch_size: int = option(
        1, "Sequences per pipeline microbatch; local_batch_size / this = microbatches per step."
    )
    pipeline_parallel_layers_per_stage: int | None = option(
        None, "Transformer layers per pipeline stage (the last stage takes the rest); none = as many stages as "
        "the schedule runs per rank (1 or 2) times the pp degree, layers split evenly."
    )
    pipeline_parallel_split_points: list[str] = option(
        [], "Layers that start a new pipeline stage, e.g. ['layers.2', 'layers.4'] for 3 stages; "
        "[] = split by pipeline_parallel_layers_per_stage or evenly."
    )
    fsdp_implementation: str = option(
        "simple", "Data-parallel wrapper: 'simple' (SimpleFSDP, compiles whole) or 'fsdp2' (PyTorch's "
        "fully_shard, the eager baseline; compiled per block).", choices=("simple", "fsdp2"),
    )
    fsdp_reshard_after_forward: str = option(
        "default", "Free gathered weights after forward and gather again in backward: always, never, or "
        "default (always, except under pipeline parallel where it would gather once per microbatch).",
        choices=("default", "always", "never"),
    )
    fsdp_gather: str = option(
        "auto", "When SimpleFSDP gathers weights in a step of several microbatches (pipeline microbatches or "
        "gradient accumulation): per_microbatch (every microbatch all-gathers and reduce-scatters; least "
        "memory), once_per_step (all-gather once, keep the unsharded weights and their gradients across the "
        "microbatches, reduce-scatter once: 1/microbatches of the traffic, more memory), or auto (once_per_step "
        "under pipeline parallel, where a rank holds one stage's weights; per_microbatch otherwise).",
        choices=("auto", "per_microbatch", "once_per_step"),
    )


@dataclass
class ActivationCheckpoint:
    mode: str = option(
        "none", "Recompute activations in backward to save memory: none, full (whole blocks) or selective.",
        choices=("none", "full", "selective"),
    )
    selective_ac_option: str = option(
        "op", "For selective: 'op' saves attention outputs and every second matmul output of each block (wq, wv, "
        "w1, w2; TorchTitan's trade-off) and recomputes the rest; 'op_all_matmuls' saves every matmul output "
        "(less recompute, more memory); an integer N checkpoints every N-th block fully."
    )


@dataclass
class Compile:
    enable: bool = option(False, "torch.compile the model (whole model, fullgraph, with SimpleFSDP).")
    backend: str = option("inductor", "Compiler backend; aot_eager helps debugging.", choices=("inductor", "aot_eager"))
    bucketing: str = option(
        "transformer_block", "SimpleFSDP collective bucketing (inductor only): none (one all-gather / "
        "reduce-scatter per parameter), transformer_block (one per bucket of manual_bucketed_modules, default: "
        "embeddings, each block, [norm, output]; the default, fastest in every benchmark) or auto (Inductor's "
        "overlap scheduler picks the buckets from a runtime model).",
        choices=("none", "transformer_block", "auto"),
    )
    manual_bucketed_modules: list[str | list[str]] = option(
        [], "With bucketing=transformer_block: the buckets, in order, each a module FQN or a list of FQNs, "
        "e.g. ['tok_embeddings', 'layers.0', 'layers.1', ['norm', 'output']]; [] = one per transformer block."
    )
    reorder: bool = option(
        True, "Move collectives so they overlap compute: prefetch the next bucket's all-gather, defer the "
        "reduce-scatter's wait (auto bucketing always reorders)."
    )
    regional: bool = option(
        False, "Regional compilation: compile one region of regional_blocks transformer blocks and reuse its code "
        "for every region (three codes: the embedding's small region, the block regions, the last region, which "
        "also runs the final norm and output; the loss runs eagerly). Start-up time hardly grows with depth. Each "
        "region's collectives are bucketed and reordered inside it; without pipeline parallel, with reorder and "
        "per-microbatch gathering, each region also gathers the next region's first weights while its last block "
        "computes (docs/benchmarks.md, 'Compile time against depth')."
    )
    regional_blocks: int = option(
        2, "With regional = true: how many consecutive transformer blocks one compiled region holds. Inside a "
        "region each bucket's all-gather is issued while the one before computes, as in the whole-model graph; "
        "a region's last bucket (its last block's w2) is gathered again, exposed, at the start of its backward, "
        "and the next region's first weights (a block's attention norm and q / k / v) stay unsharded from its "
        "forward to its backward. More blocks per region: less of both, a longer compile (about one block's "
        "each). A depth that is not a multiple compiles its shorter last region too."
    )
    cache_dir: str = option(
        "", "Where compiled graphs and kernels are kept for the next start (torch's compile caches); '' = "
        "<dump_folder>/compile_cache. A restart with the same model, layout, shapes and compile settings loads "
        "them instead of compiling, and one log line after step 1 says which. On a cluster, a folder every node "
        "can read. An explicit TORCHINDUCTOR_CACHE_DIR in the environment wins."
    )
    compile_on_one_rank: bool = option(
        True, "In a multi-rank job, each graph is compiled once per class of ranks with the same graphs: the same "
        "pipeline stage and the same process group in every other mesh dimension (a compiled graph names the "
        "groups of its collectives). The lowest rank of each class compiles into the compile cache folder and "
        "the others load from there: data parallel alone is one class (rank 0 compiles), pipeline parallel one "
        "per stage, while tensor and context parallel and HSDP put ranks in different groups, so several ranks "
        "compile. The folder must be one every rank reads (cache_dir; a rank that "
        "cannot see it compiles its own, with a warning). false: every rank compiles its graphs itself. One line "
        "after step 1 says who compiled and who loaded what."
    )
    precompile_world_size: int = option(
        0, "Compile ahead instead of training: from this one process, write the graphs of a job of this many "
        "ranks (this config, its degrees) into cache_dir, and stop; the job launched afterwards loads them and "
        "compiles nothing (its line after step 1 says so). Each compiling rank (rank 0; under pipeline parallel each "
        "stage's first) is built on a fake process group and runs one step on random tokens: it needs that rank's "
        "memory and the job's device kind (one GPU of the same kind for a CUDA job). 0 = train."
    )
    precompile_device: str = option(
        "auto", "The device to precompile for: auto (CUDA when this machine has a GPU, else CPU), cpu or cuda.",
        choices=("auto", "cpu", "cuda"),
    )


@dataclass
class Comm:
    init_timeout_seconds: int = option(
        1800, "How long a collective waits for its peers until this process's first training step has ended "
        "(and during the first validation of a compiled run): it must cover start-up, checkpoint loading and every "
        "compile, which under pipeline parallel happen one stage after another while the other stages wait."
    )
    train_timeout_seconds: int = option(
        600, "How long a collective waits for its peers after the first step: a rank that died or hung fails the "
        "job within this time (NCCL: the watchdog aborts, and the flight recorder writes what each rank was doing)."
    )
    trace_buf_size: int = option(
        20000, "NCCL flight recorder: how many collectives each rank remembers (0 turns it off). On a timeout every "
        "rank writes them to <dump_folder>/<save_traces_folder>/rank_<rank>; `torchfrtrace <that folder>` shows "
        "which ranks were stuck where. Left alone when TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE is set."
    )
    save_traces_folder: str = option("comm_traces", "Flight recorder dump folder under dump_folder.")


@dataclass
class Metrics:
    log_freq: int = option(10, "Log metrics every this many steps (and at the first and last step).")
    enable_tensorboard: bool = option(True, "Write TensorBoard event files.")
    save_tb_folder: str = option("tb", "TensorBoard folder under dump_folder.")
    enable_wandb: bool = option(
        False, "Also log to Weights & Biases (pip install -e '.[wandb]'): the same values at the same steps as "
        "TensorBoard, from rank 0, with the job config as the run's config. The run's id is kept in "
        "<dump_folder>/wandb_run_id: a run resumed from a checkpoint continues that W&B run (steps it already holds "
        "stay as they were), a run from step 1 starts a new one; WANDB_RUN_ID wins over both. Files go to "
        "<dump_folder>/wandb (or WANDB_DIR); WANDB_MODE=offline keeps them there for `wandb sync`. One log line says "
        "where the run is; WANDB_SILENT=false brings back wandb's own output."
    )
    wandb_project: str = option(
        "", "W&B project; '' = the WANDB_PROJECT environment variable, else 'titan_simple'. Like the other wandb_* "
        "keys, a value set here wins over its environment variable (as wandb.init's arguments do)."
    )
    wandb_entity: str = option("", "W&B entity (user or team); '' = WANDB_ENTITY, else your default entity.")
    wandb_run_name: str = option("", "W&B run's display name; '' = WANDB_NAME, else a name W&B makes up.")


@dataclass
class Validation:
    enable: bool = option(False, "Evaluate loss and perplexity on held-out data every freq steps and at the last.")
    dataset: str = option(
        "shakespeare", "Held-out data: the built-in 'shakespeare' corpus's validation split (plays it never trains "
        "on), or local files read as 'text', 'json', 'parquet' or 'auto' from dataset_path.",
    )
    dataset_path: str | None = option(
        None, "Local file, folder or glob of held-out data (needed unless the dataset is built in)."
    )
    mixture: list[MixtureSource] = option(
        [], "Held-out data per source instead of dataset / dataset_path: [[validation.mixture]] tables as "
        "[[training.mixture]]'s. Each source's loss and perplexity is logged, and the mixture's: the losses "
        "weighted by the entries' weights."
    )
    freq: int = option(100, "Validate every this many training steps (and at the last step).")
    steps: int = option(
        10, "Batches per validation; -1 = the whole held-out set (until the first data-parallel rank runs out)."
    )
    local_batch_size: int = option(-1, "Sequences per data-parallel rank per batch; -1 = [training] local_batch_size.")
    seq_len: int = option(-1, "Tokens per sequence; -1 = [training] seq_len (which is also the upper limit).")


@dataclass
class Profiling:
    enable_profiling: bool = option(
        False, "Record torch.profiler traces (Chrome/Perfetto JSON, one per rank) every profile_freq steps."
    )
    save_traces_folder: str = option(
        "profile_traces", "Trace folder under dump_folder: <folder>/iteration_N/rankR_trace.json."
    )
    profile_freq: int = option(10, "Profile the last profiler_active steps of every profile_freq steps.")
    profiler_warmup: int = option(
        3, "Steps the profiler runs but discards before each recording (its start-up skews the first)."
    )
    profiler_active: int = option(1, "Steps recorded per trace.")
    enable_memory_snapshot: bool = option(
        False, "CUDA: record allocator history and dump a snapshot every profile_freq steps and on OOM (open it "
        "at pytorch.org/memory_viz). CPU: a memory timeline from the profiler instead, with one process only.",
    )
    save_memory_snapshot_folder: str = option(
        "memory_snapshot", "Memory snapshot folder under dump_folder: <folder>/iteration_N/rankR_*."
    )


@dataclass
class Checkpoint:
    enable: bool = option(False, "Save checkpoints (and resume from the newest complete one at start-up).")
    folder: str = option("checkpoint", "Checkpoint folder under dump_folder; each save is a step-N subfolder.")
    interval: int = option(500, "Save every this many steps (and at the last step, and on SIGTERM/SIGINT).")
    keep_latest_k: int = option(
        0, "Keep only the newest k complete checkpoints, deleting older ones after each save; 0 keeps all."
    )
    async_mode: str = option(
        "disabled", "async: copy the state to CPU memory and write it in a background thread while training "
        "goes on (the last save and a save on a stop request are always synchronous).",
        choices=("disabled", "async"),
    )
    load_step: int = option(-1, "Step to resume from; -1 = the newest complete checkpoint.")
    initial_load_path: str | None = option(
        None, "When the checkpoint folder holds none: start from this step-N folder (DCP) or Hugging Face Llama "
        "folder (config.json + *.safetensors), e.g. a seed checkpoint or pretrained weights.",
    )
    initial_load_model_only: bool = option(
        True, "From initial_load_path take only the model weights (optimizer, data, step start fresh)."
    )
    last_save_model_only: bool = option(
        False, "At the last step save only the model, in export_dtype (smaller; it cannot resume training)."
    )
    last_save_in_hf: bool = option(
        False, "At the last step also write the model in Hugging Face Llama format to step-N/hf (safetensors + "
        "config.json, in export_dtype)."
    )
    export_dtype: str = option(
        "float32", "dtype of model-only and Hugging Face saves.", choices=("float32", "bfloat16", "float16")
    )
    exclude_from_loading: list[str] = option(
        [], "Parts of a checkpoint not to restore on resume, from: optimizer, lr_scheduler, dataloader, "
        "train_state, rng (e.g. ['dataloader'] to restart the data)."
    )
    create_seed_checkpoint: bool = option(
        False, "Initialize the model, save it as step-0 (model only) into an empty checkpoint folder and exit; "
        "later runs on any layout start from it."
    )


@dataclass
class FaultTolerance:
    enable: bool = option(
        False, "Fault-tolerant replica groups (torchft; needs the ft extra): the data-parallel world is group_size "
        "groups, each its own torchrun job with this config (SimpleFSDP / TP / PP inside); after SimpleFSDP's own "
        "reductions the gradients are averaged across the live groups, and a group that dies is left out while the "
        "others keep training. A restarted group receives the live weights from a peer (README, fault tolerance)."
    )
    replica_id: int = option(0, "This group's index, 0 .. group_size - 1: which rows of each global batch it reads.")
    group_size: int = option(0, "How many replica groups the job is laid out for (the global batch spans them all).")
    min_replica_size: int = option(
        1, "The fewest live groups a step may commit with; with fewer, the groups wait and retry the step."
    )
    lighthouse: str = option(
        "", "Address of the torchft lighthouse, e.g. http://host:29510 (\"\" = $TORCHFT_LIGHTHOUSE). Start one with "
        "`torchft_lighthouse --min_replicas 1` (scripts/fault_tolerance.py does it for one machine)."
    )
    timeout_seconds: float = option(
        60.0, "How long the cross-group all-reduce, a commit or one tensor of a weight transfer waits for a peer group "
        "before the step is abandoned (not committed) and retried with the groups still alive."
    )
    heal_gb_per_second: float = option(
        1.0, "The slowest rate a healing group may receive its state at: the recovery timeout (the whole transfer of "
        "this rank's parameter and optimizer shards, over the groups' NCCL or gloo group) is timeout_seconds + those "
        "bytes / this rate. 1 GB/s is far below NCCL between nodes; lower it for slow links."
    )
    quorum_timeout_seconds: float = option(
        300.0, "How long a group waits for the lighthouse to form a quorum (enough live groups) before it fails."
    )
    bucket_cap_mb: float = option(
        256.0, "The cross-group gradient all-reduce goes in buckets of at most this many MB of gradient shards (slices "
        "of the one buffer the gradients live in; 256 MB: 16 all-reduces per step for Llama 3 8B on 8 GPUs)."
    )
    allreduce_in_bf16: bool = option(
        False, "Average the gradients across the groups in bf16 (half the bytes between groups; one persistent bf16 "
        "buffer of the gradient shards, and their rounding) instead of in their own dtype (fp32)."
    )
    log_shard_hashes: bool = option(
        False, "After every committed step, write a hash of each rank's parameter and optimizer shards to "
        "<dump_folder>/replica_<id>/shard_hashes_rank<r>.jsonl: groups that agree write the same lines (a debug aid)."
    )


@dataclass
class DryRun:
    enable: bool = option(
        False, "Plan instead of train (also: a bare --dry_run): build one rank of world_size on the meta device "
        "with a fake process group, trace one step, and print per-rank memory, collectives and a roofline "
        "step time / tokens/s / MFU; writes dry_run.json to dump_folder. Needs no GPU, allocates nothing.",
    )
    world_size: int = option(8, "Number of devices to plan for (the product of the parallel degrees).")
    rank: int = option(0, "The rank to build; ranks differ by pipeline stage (pp rank 0 holds the most activations).")
    device: str = option(
        "h100", "Device for the roofline: h100 (SXM 80GB), h200, a100 (SXM 80GB), or cpu (rates measured here).",
        choices=("h100", "h200", "a100", "cpu"),
    )
    comm_overlap: str = option(
        "auto", "Whether data-parallel collectives hide behind compute: auto (when [compile] reorders them: "
        "reorder = true or bucketing = auto), overlapped, or exposed.", choices=("auto", "overlapped", "exposed"),
    )
    collective_bandwidth: float = option(
        0.0, "device = cpu only: the measured gloo all-gather bandwidth in bytes/s (0 = a nominal 1 GB/s)."
    )
    search: bool = option(
        False, "Rank the layouts of this model on world_size devices instead of planning one: every valid mix of "
        "the parallel degrees, HSDP, local batch, pipeline schedule and microbatch, SimpleFSDP gathering, "
        "activation checkpointing (and float8 with search_float8), at this config's global batch; prints the "
        "fastest that fit and writes every candidate to search.json (docs/dry_run.md, 'Layout search')."
    )
    search_top: int = option(15, "Rows of the search's table (the fastest layouts that fit).")
    search_fix: list[str] = option(
        [], "Pin knobs of the search, as section.key=value, e.g. ['parallelism.tensor_parallel_degree=8'] (or "
        "comma-separated on the command line)."
    )
    search_batch: bool = option(
        False, "Let the search halve or double the global batch too (default: held at this config's)."
    )
    search_float8: bool = option(
        False, "Search float8 linears on and off (h100 / h200); default: as [model] converters says."
    )
    search_workers: int = option(2, "Processes pricing layouts in parallel.")
    search_layouts: int = option(
        0, "Price at most this many layouts, in the order of their speed ceilings (0 = 24 up to 64 GPUs, 100 above). "
        "A count, not a time: the same search gives the same table on a quiet or a loaded machine; the table says "
        "what the count left unpriced and how fast it could have been."
    )
    search_seconds: float = option(
        0.0, "Also stop pricing this many seconds after the search starts (0 = no time limit). A time limit makes "
        "the table depend on the machine's load: a busy machine prices fewer layouts (the table says so)."
    )
    memory_headroom: float = option(
        -1.0, "The free memory a recommended layout must keep, as a fraction of its planned device memory "
        "(reserved + runtime): -1 = 0.16, the dry run's largest under-prediction of a published run's reserved "
        "memory (docs/dry_run.md). A layout that fits with less is never recommended; the table counts them."
    )
    gpus_per_node: int = option(8, "GPUs per node of the planned cluster: tensor parallel stays inside a node.")
    full_trace: bool = option(
        False, "Trace every transformer block instead of 2 and 3 blocks per pipeline stage carried to the full "
        "depth (the same numbers to float rounding, several times slower; dry_run/extrapolation.py)."
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    float8: Float8 = field(default_factory=Float8)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    comm: Comm = field(default_factory=Comm)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    dry_run: DryRun = field(default_factory=DryRun)
    config_file: str | None = None  # where the TOML came from, for messages
    sources: dict[str, str] = field(default_factory=dict)  # "section.key" -> file or "command line"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in sections()}


def sections() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(JobConfig) if f.name not in ("config_file", "sources")]
