"""The preallocated buffers of a decoder run (model/decoder.py), carved from one slab that a
workspace pool reuses.

Why a pool. A run's buffers are large (d=512, L=4, B=8, T=64: ~130 MB of saved activations,
output-gradient rings and K/V gradients) and touched once or twice per step. Fresh memory
faults in page by page (measured: a fresh (8, 512) slot takes ~2x longer to write than a
reused one), so every run takes one slab from :data:`WORKSPACE` and gives it back when it is
garbage-collected (the autograd graph that holds it is freed), and the next step of the same
shape finds it there. On CUDA the caching allocator does this already; the pool is harmless.
``WORKSPACE.clear()`` returns the memory (the memory benchmark calls it before each measured
step, so that a step's peak counts its slab).
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

SLAB_ALIGN = 64  # bytes: every buffer of a slab starts on a cache line


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to whole cache lines: what a buffer takes in its slab."""
    return -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN


class Workspace:
    """Free slabs (uint8 tensors) by device; a run takes the smallest that fits."""

    def __init__(self, max_free_bytes: int = 8 << 30) -> None:
        self._free: dict[torch.device, list[torch.Tensor]] = {}
        # reentrant: a finalizer (give) can run inside take when the garbage collector fires there
        self._lock = threading.RLock()
        self.max_free_bytes = max_free_bytes

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._free.get(device, [])
            fits = [j for j, s in enumerate(free) if nbytes <= s.numel() <= 2 * nbytes]
            if fits:
                return free.pop(min(fits, key=lambda j: free[j].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, slab: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(slab.device, [])
            free.append(slab)
            while sum(s.numel() for s in free) > self.max_free_bytes:
                free.pop(0)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.numel() for free in self._free.values() for s in free)


WORKSPACE = Workspace()


class Slab:
    """Carves typed buffers out of one allocation. Declare every buffer with :meth:`add`, then
    :meth:`allocate` once; ``owner``'s garbage collection gives the slab back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._specs: list[tuple[str, tuple, torch.dtype, bool]] = []
        self.nbytes = 0
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, shape: tuple, dtype: torch.dtype, zero: bool = False) -> None:
        self._specs.append((name, tuple(shape), dtype, zero))

    def allocate(self, owner: object, pooled: bool = True) -> dict[str, torch.Tensor]:
        """pooled=False: a fresh allocation, freed with the tensors (a slab that lives only part
        of a step: held by the pool, its memory would stay taken for the rest of the step)."""
        sizes = self.sizes()
        total = max(sum(sizes.values()), SLAB_ALIGN)
        if pooled:
            slab = WORKSPACE.take(total, self.device)
            weakref.finalize(owner, WORKSPACE.give, slab)
        else:
            slab = torch.empty(total, dtype=torch.uint8, device=self.device)
        off = 0
        for name, shape, dtype, zero in self._specs:
            t = slab[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            if zero:
                t.zero_()
            self.tensors[name] = t
            off += sizes[name]
        self.nbytes = off
        tensors, self.tensors = self.tensors, {}  # the caller's (a released slab must not stay referenced here)
        return tensors

    def sizes(self) -> dict[str, int]:
        """Each declared buffer's bytes in the slab (aligned), allocated or not."""
        return {name: aligned(math.prod(shape) * dtype.itemsize) for name, shape, dtype, _ in self._specs}
