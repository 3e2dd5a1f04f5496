"""A dispatch-level tracker of live tensor bytes that keeps only the global peak (used by the
pre-flight profile, finetune_trainer.profile, and by bench/sizing_truth.py).

It stands in for `torch.distributed._tools.mem_tracker.MemTracker`, which walks
every module after every op (slow on deep models) and hooks every parameter
(crashes on frozen ones, e.g. under LoRA). This tracker only:

* counts each storage once, when an op first returns it, rounded up to the CUDA
  caching allocator's 512-byte block size (what `max_memory_allocated` counts);
* subtracts it when the storage dies (weakref callback);
* follows `UntypedStorage.resize_`, which FSDP2 uses to free and re-allocate
  all-gathered parameters outside the dispatcher;
* ignores ops run under a different fake mode (DTensor's sharding propagation
  builds global-shape tensors that never exist on a device).

Phases: `mark(phase)` names what runs next; `phase_peaks` keeps the peak per phase.

Recording (opt-in, `PeakTracker(record=True)`): `events` holds the ordered trace of
allocations `(serial, nbytes)` and frees `(serial, None)`, in the rounded sizes counted
above, for the caching-allocator model (finetune_operator.sizing.allocator.replay). A
`resize_` to another non-zero size is recorded as the new buffer's allocation, then the old
one's free (the storage copies into a new allocation). Off, nothing is recorded.
"""

from __future__ import annotations

import weakref
from functools import wraps

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CUDA_BLOCK_BYTES = 512


def _rounded(nbytes: int) -> int:
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


class PeakTracker(TorchDispatchMode):
    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.events: list[tuple[int, int | None]] | None = [] if record else None
        self._serials: dict[int, int] = {}  # storage key -> serial of its allocation (recording only)
        self._next_serial = 0
        self.current = 0
        self.peak = 0
        self.phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._fake_mode = None
        self._orig_resize = None

    # ---- bookkeeping -------------------------------------------------------
    def _bump(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
        if self.current > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.current

    def _record_alloc(self, key: int, size: int) -> None:
        if size:
            self._serials[key] = self._next_serial
            self.events.append((self._next_serial, size))
            self._next_serial += 1

    def _record_free(self, key: int) -> None:
        serial = self._serials.pop(key, None)
        if serial is not None:
            self.events.append((serial, None))

    def _on_death(self, key: int, _ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]
            if self.events is not None:
                self._record_free(key)

    def _track_storage(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        entry = self._live.get(key)
        if entry is not None and entry[0]() is st:
            return
        size = _rounded(st.nbytes())
        if self.events is not None:
            self._record_free(key)  # a dead storage whose id was reused before its callback ran
            self._record_alloc(key, size)
        self._live[key] = (weakref.ref(st, lambda r, k=key: self._on_death(k, r)), size)
        self._bump(size)

    def track(self, t) -> None:
        """Count a tensor created before the tracker was entered (or outside the dispatcher)."""
        if isinstance(t, torch.Tensor) and not t.is_meta:
            inner = getattr(t, "_local_tensor", None)
            self._track_storage((inner if inner is not None else t).untyped_storage())

    def mark(self, phase: str) -> None:
        self.phase = phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)

    def reset_peak(self) -> None:
        self.peak = self.current
        self.phase_peaks = {}

    # ---- mode ----------------------------------------------------------------
    def __enter__(self):
        self._fake_mode = active_fake_mode()
        self._orig_resize = torch.UntypedStorage.resize_
        orig = self._orig_resize
        tracker = self

        @wraps(orig)
        def resize_(st, size):
            key = id(st)
            entry = tracker._live.get(key)
            result = orig(st, size)
            if entry is not None and entry[0]() is st:
                new = _rounded(st.nbytes())
                tracker._live[key] = (entry[0], new)
                tracker._bump(new - entry[1])
                if tracker.events is not None and new != entry[1]:
                    old = tracker._serials.pop(key, None)
                    tracker._record_alloc(key, new)
                    if old is not None:
                        tracker.events.append((old, None))
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor unwrap to local ops first
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            # The fake wait_tensor returns a new tensor; a real one waits in place.
            return args[0]
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._track_storage(t.untyped_storage())
        return out
