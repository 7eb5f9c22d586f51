"""Per-rank tensor memory of one training step: SimpleFSDP with and without reshard-after-forward, FSDP2.

    python scripts/benchmarks/measure_memory.py            # 2 gloo ranks on CPU, a few minutes; rewrites the tables
                                                # between the markers in docs/simple_fsdp_memory.md
    python scripts/benchmarks/measure_memory.py --no-doc   # print the tables only

The model and its step are the trainer's own (``core.assemble.build_run``; the probes below
watch the step through its ``StepHooks``), ``debugmodel_large`` (8 blocks, dim 512) by default, fully_shard
on 2 processes, fp32. Each case runs one warm-up step (it creates the optimizer state and, compiled, compiles)
and measures the second: ``zero_grad`` -> forward -> loss -> backward -> clip -> ``optimizer.step()``.

Two figures, because no single method sees everything on CPU (there are no allocator statistics):

* ``LiveTensorBytes`` (eager only): a TorchDispatchMode under DTensor that sees every aten op on plain tensors.
  It counts the bytes of distinct tensor *storages* (one count per storage, however many views share it) that
  are alive: the parameter shards, gradients, optimizer state, buffers and the batch registered at the start,
  plus every storage an op reads or writes during the step. A storage stops counting when it is freed (a
  weakref finalizer on the storage) and is counted at its current size when resized (FSDP2 frees and
  re-allocates its unsharded parameters with ``UntypedStorage.resize_``, which this script wraps). Peaks are
  taken after every op and every resize. Not counted: anything that is not a tensor storage (Python objects,
  gloo's buffers, allocator caches and fragmentation) and tensors no dispatched op touches. It cannot look
  inside compiled code: Inductor allocates its buffers without the dispatcher.
* ``SavedForBackward`` (eager and compiled): ``torch.autograd.graph.saved_tensors_hooks`` around the forward
  and the loss; the sum of the unique storages of every saved tensor, read at the end of the forward (so a
  storage FSDP2 has resized to 0 counts 0), leaving out storages that exist anyway (parameter shards,
  buffers, the batch). A compiled graph saves its tensors through one autograd Function, so the hooks see all
  of them. In eager, ``torch.utils.checkpoint`` installs its own hooks inside each checkpointed block, which
  hide the block's saves from ours: with reshard-after-forward (every block is checkpointed) this figure
  misses the blocks entirely, and the dispatch-mode figure "kept for backward" (live bytes after the loss
  minus live bytes before the forward) is the one to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pickle
import tempfile
import time
import weakref

import harness
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from titan_simple.config import load_job_config
from titan_simple.core.assemble import build_run
from titan_simple.core.plan import resolve_plan
from titan_simple.core.step import StepHooks
from titan_simple.dry_run.live_storage import LiveStorageBytes
from titan_simple.models.llama3 import build_model

DOC = harness.DOCS / "simple_fsdp_memory.md"
BEGIN, END = "<!-- measure_memory.py: begin -->", "<!-- measure_memory.py: end -->"
MB = 1e6
DEVICE = torch.device("cpu")
WORLD_SIZE = 2

SIMPLE_RESHARD = ("--parallelism.fsdp_reshard_after_forward=always",)
SIMPLE_KEEP = ("--parallelism.fsdp_reshard_after_forward=never",)
FSDP2 = ("--parallelism.fsdp_implementation=fsdp2",)
COMPILE = ("--compile.enable",)
REPLICATE = (f"--parallelism.data_parallel_replicate_degree={WORLD_SIZE}", "--parallelism.data_parallel_shard_degree=1")
CASES: dict[str, tuple[str, ...]] = {
    "SimpleFSDP, reshard after forward, eager": SIMPLE_RESHARD,
    "SimpleFSDP, no reshard, eager": SIMPLE_KEEP,
    "FSDP2, reshard after forward, eager": (*FSDP2, *SIMPLE_RESHARD),
    "FSDP2, no reshard, eager": (*FSDP2, *SIMPLE_KEEP),
    # Nothing gathered, nothing checkpointed: "kept for backward" is the activations alone.
    "SimpleFSDP replicate (DDP), eager": REPLICATE,
    "SimpleFSDP, reshard after forward, compiled": (*SIMPLE_RESHARD, *COMPILE),
    "SimpleFSDP, no reshard, compiled": (*SIMPLE_KEEP, *COMPILE),
}


# ---------------------------------------------------------------------------------------------- probes


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. a functional-collective wrapper without storage
        return None


class LiveTensorBytes(LiveStorageBytes):
    """Live bytes of the distinct tensor storages the step holds or touches, and their peak (see the module
    docstring for exactly what is counted): the dry run's counter (``LiveStorageBytes``, shared with
    ``StepTracer``) with every dispatched op's tensors tracked and storage resizes followed. Storages are
    keyed by their C++ object, so views and ``resize_`` keep one entry; ``phase`` names the part of the step
    peaks are attributed to."""

    def _storage_of(self, t) -> torch.UntypedStorage | None:
        return _storage(t)

    def resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            self.live += storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
        else:
            self.track(torch.empty(0).set_(storage))  # first seen at its new size
        self.sample()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor unwrap: its local ops come back through this mode
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.track(t)
        self.sample()
        return out


_ACTIVE_TRACKER: LiveTensorBytes | None = None
_original_resize = torch.UntypedStorage.resize_


def _tracking_resize(self, size):
    result = _original_resize(self, size)
    if _ACTIVE_TRACKER is not None:
        _ACTIVE_TRACKER.resized(self)
    return result


torch.UntypedStorage.resize_ = _tracking_resize  # FSDP2 frees / re-allocates unsharded params this way


class SavedForBackward:
    """Unique storages of the tensors autograd saves inside ``hooks()``, minus ``exclude`` (storages that exist
    anyway); ``nbytes()`` reads their current sizes."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self._refs: dict[int, weakref.ref] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage is not None and storage._cdata not in self.exclude:
            self._refs.setdefault(storage._cdata, weakref.ref(storage))
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in (r() for r in self._refs.values()) if s is not None)


# ---------------------------------------------------------------------------------------------- one case


def _config(args, overrides: tuple[str, ...], dump_folder: str):
    return load_job_config(
        [
            f"--model.flavor={args.flavor}",
            f"--training.seq_len={args.seq_len}",
            f"--training.local_batch_size={args.local_batch}",
            "--training.mixed_precision_param=float32",
            f"--job.dump_folder={dump_folder}",
            *overrides,
        ]
    )


def _persistent_tensors(model, optimizer, batch) -> list[torch.Tensor]:
    tensors = [p for p in model.parameters()] + [b for b in model.buffers()] + list(batch)
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = _storage(t)
        if s is not None:
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class _StepProbes(StepHooks):
    """Watches the training step: the saved-tensor hooks around forward + loss, and (eager) the live-bytes
    tracker's phases and what the forward keeps for backward."""

    def __init__(self, saved: SavedForBackward, tracker: LiveTensorBytes | None) -> None:
        self.saved, self.tracker = saved, tracker
        self._hooks = contextlib.ExitStack()
        self.before = self.kept = 0

    def phase(self, name: str) -> None:
        if self.tracker is not None:
            self.tracker.set_phase(name)
        if name == "forward":
            self.before = self.tracker.live if self.tracker is not None else 0
            self._hooks.enter_context(self.saved.hooks())
        elif name == "backward":  # the loss is computed: what the forward left for backward is alive now
            self._hooks.close()
            self.kept = (self.tracker.live if self.tracker is not None else 0) - self.before


def measure_case(rank: int, world_size: int, args, overrides: tuple[str, ...], dump_folder: str) -> dict:
    global _ACTIVE_TRACKER
    config = _config(args, overrides, dump_folder)
    plan = resolve_plan(config, world_size, DEVICE.type)  # the trainer's plan, build and step
    compiled = plan.compile.enabled
    if compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    run = build_run(plan, DEVICE, lr_schedule=False)
    parts, optimizer, train_step, dp_rank, dp_size = run.parts, run.optimizer, run.step, run.dp_rank, run.dp_size
    model = parts.model
    training = config.training
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (training.local_batch_size * dp_size, training.seq_len + 1),
                           generator=generator)
    rows = slice(dp_rank * training.local_batch_size, (dp_rank + 1) * training.local_batch_size)
    batch = (tokens[rows, :-1].contiguous(), tokens[rows, 1:].contiguous())

    start = time.perf_counter()
    train_step([batch])  # warm-up: optimizer state, compilation
    warmup_s = time.perf_counter() - start

    optimizer.zero_grad()  # what the step does first: last step's gradients die here
    gc.collect()
    persistent = _persistent_tensors(model, optimizer, batch)
    result = {
        "warmup_s": warmup_s,
        "params_bytes": _storage_bytes(list(model.parameters())),
        "optimizer_bytes": _storage_bytes(
            [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        ),
        "persistent_bytes": _storage_bytes(persistent),
    }
    exclude = {s._cdata for s in map(_storage, persistent) if s is not None}
    saved = SavedForBackward(exclude)
    if compiled:
        train_step.hooks = probes = _StepProbes(saved, None)
        train_step([batch])
        result["saved_bytes"] = saved.nbytes()
        counters = torch._dynamo.utils.counters
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["unique_graphs"] = counters["stats"]["unique_graphs"]
    else:
        tracker = LiveTensorBytes()
        for tensor in persistent:
            tracker.track(tensor)
        _ACTIVE_TRACKER = tracker
        try:
            with tracker:
                train_step.hooks = probes = _StepProbes(saved, tracker)
                train_step([batch])
                tracker.set_phase("end")
        finally:
            _ACTIVE_TRACKER = None
        result.update(kept_bytes=probes.kept, saved_bytes=saved.nbytes(), start_bytes=probes.before,
                      peak_bytes=tracker.peak, phase_peaks=dict(tracker.phase_peaks))
    if rank == 0:
        print(f"  {overrides}: warm-up {warmup_s:.1f} s", flush=True)
    return result


def _model_facts(args) -> dict:
    model = build_model(args.flavor, max_seq_len=args.seq_len, device="meta")

    def nbytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    return {
        "n_layers": len(model.layers),
        "block_bytes": nbytes(model.layers["0"]),
        "embedding_bytes": nbytes(model.tok_embeddings),
        "output_bytes": nbytes(model.output) + nbytes(model.norm),
        "total_bytes": nbytes(model),
        "dim": model.args.dim,
    }


# ---------------------------------------------------------------------------------------------- processes


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, args) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    from titan_simple.parallel.torch_private import use_one_gloo_worker_thread

    use_one_gloo_worker_thread()  # as the trainer does
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    results = {}
    try:
        with tempfile.TemporaryDirectory() as dump_folder:  # compile writes its comm plan there
            for name, overrides in CASES.items():
                if args.eager_only and "--compile.enable" in overrides:
                    continue
                if rank == 0:
                    print(f"measuring: {name}", flush=True)
                results[name] = measure_case(rank, world_size, args, overrides, dump_folder)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(WORLD_SIZE, os.path.join(tmp, "store"), tmp, args), nprocs=WORLD_SIZE)
        results = []
        for rank in range(WORLD_SIZE):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


# ---------------------------------------------------------------------------------------------- report


def _mb(x) -> str:
    return "-" if x is None else f"{x / MB:.1f}"


def tables(results: list[dict], facts: dict, args, elapsed_s: float) -> str:
    rank0 = results[0]
    ws = WORLD_SIZE
    lines = [
        f"Measured by `scripts/benchmarks/measure_memory.py` ({elapsed_s:.0f} s): `{args.flavor}` "
        f"({facts['n_layers']} blocks, dim {facts['dim']}), fully_shard on {ws} gloo processes (CPU), fp32, "
        f"local batch {args.local_batch} x {args.seq_len} tokens, AdamW (foreach). Rank 0, second step; "
        f"MB = 10^6 bytes.",
        "",
        "| case | at step start | kept for backward (dispatch) | saved-tensor hooks | peak forward "
        "| peak backward | peak optimizer | step peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rank0.items():
        phases = r.get("phase_peaks", {})
        lines.append(
            f"| {name} | {_mb(r['persistent_bytes'])} | {_mb(r.get('kept_bytes'))} | {_mb(r['saved_bytes'])} "
            f"| {_mb(phases.get('forward'))} | {_mb(phases.get('backward'))} | {_mb(phases.get('optimizer'))} "
            f"| {_mb(r.get('peak_bytes'))} |"
        )
    compiled = [r for r in rank0.values() if "graph_breaks" in r]
    extra = []
    if compiled:
        extra.append(
            "Compiled cases: "
            + ", ".join(f"{r['graph_breaks']} graph breaks / {r['unique_graphs']} graph" for r in compiled)
            + " (the measured step reuses the warm-up's compilation with the hooks installed)."
        )
    spread = max(
        abs(results[k][name][key] - rank0[name][key]) / max(1, rank0[name][key])
        for k in range(1, len(results))
        for name in rank0
        for key in ("saved_bytes", "persistent_bytes")
    ) if len(results) > 1 else 0.0
    extra.append(f"Largest difference between ranks in these figures: {spread:.1%}.")
    block, n = facts["block_bytes"], facts["n_layers"]
    r_any = next(iter(rank0.values()))
    theory = [
        "",
        "Model arithmetic for this run (per rank unless said otherwise):",
        "",
        "| quantity | MB |",
        "|---|---:|",
        f"| one transformer block, unsharded (fp32) | {_mb(block)} |",
        f"| all {n} blocks, unsharded | {_mb(n * block)} |",
        f"| embedding, unsharded / output projection + final norm, unsharded | {_mb(facts['embedding_bytes'])} / "
        f"{_mb(facts['output_bytes'])} |",
        f"| whole model, unsharded | {_mb(facts['total_bytes'])} |",
        f"| parameter shards (1/{ws}) = gradient shards | {_mb(r_any['params_bytes'])} |",
        f"| AdamW state (exp_avg + exp_avg_sq + step) | {_mb(r_any['optimizer_bytes'])} |",
    ]
    return "\n".join([*lines, "", *extra, *theory])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel_large")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--local_batch", type=int, default=1)
    parser.add_argument("--eager_only", action="store_true", help="skip the compiled cases (quick look)")
    parser.add_argument("--no-doc", dest="doc", action="store_false", help="print, do not rewrite the doc")
    args = parser.parse_args()
    start = time.perf_counter()
    results = run(args)
    text = tables(results, _model_facts(args), args, time.perf_counter() - start)
    print(text)
    if args.doc:
        harness.write_block(DOC, BEGIN, END, text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
