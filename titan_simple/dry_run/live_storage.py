"""The live tensor-storage byte counter: the base of ``dry_run/tracer.py``'s ``StepTracer`` (the dry run) and
``scripts/benchmarks/measure_memory.py``'s ``LiveTensorBytes``. (How long a matmul, a copy and an all-gather take
on this machine is ``parallel/speed_probes.py``'s.)"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from titan_simple.parallel.torch_private import TorchDispatchMode

# ------------------------------------------------------------------------------------------ memory


class LiveStorageBytes(TorchDispatchMode):
    """The bytes of the distinct tensor storages alive: each storage is counted once, however many views share
    it (storages are keyed by their C++ object), and stops counting when it is freed (a weakref finalizer on
    the storage). ``sample(op)`` updates the peak, the op (and phase) after which it was reached, and the
    peak of the current ``phase``.

    A base for dispatch modes that sit under DTensor: subclasses decide which tensors count
    (``_storage_of``) and what ``__torch_dispatch__`` records, calling ``track`` on the tensors an op touches
    and then ``sample``."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "start"
        self.live = 0
        self.peak = 0
        self.phase_peaks: dict[str, int] = {}
        self.peak_at = ""  # the op (and phase) after which the live total peaked
        self._sizes: dict[int, int] = {}

    def _storage_of(self, t: object) -> torch.UntypedStorage | None:
        """The storage ``t`` counts with, or ``None`` when it does not count."""
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        return t.untyped_storage()

    def track(self, t: object) -> None:
        """Count ``t``'s storage as alive (once) until it is freed."""
        storage = self._storage_of(t)
        if storage is None:
            return
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live += nbytes
        weakref.finalize(storage, self._forget, key)

    def _forget(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def sample(self, op: str = "") -> None:
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, f"{self.phase}: {op}"
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.live)

    def set_phase(self, name: str) -> None:
        self.phase = name
        self.sample()

    def reset_peaks(self) -> None:
        self.peak = self.live
        self.phase_peaks = {}
