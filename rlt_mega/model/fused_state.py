"""The state of a fused decoder run (model/fused_run.py): where a position is (eager or
static), and the preallocated buffers, carved from one slab that a workspace pool reuses.

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

import threading
import weakref
from typing import Optional

import torch

SLAB_ALIGN = 64  # bytes: every buffer of a slab starts on a cache line


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
        offsets, total = [], 0
        for name, shape, dtype, _ in self._specs:
            n = 1
            for s in shape:
                n *= s
            offsets.append(total)
            total += (n * torch.empty((), dtype=dtype).element_size() + SLAB_ALIGN - 1) // SLAB_ALIGN * SLAB_ALIGN
        if pooled:
            slab = WORKSPACE.take(max(total, SLAB_ALIGN), self.device)
            weakref.finalize(owner, WORKSPACE.give, slab)
        else:
            slab = torch.empty(max(total, SLAB_ALIGN), dtype=torch.uint8, device=self.device)
        for (name, shape, dtype, zero), off in zip(self._specs, offsets):
            size = torch.empty((), dtype=dtype).element_size()
            n = 1
            for s in shape:
                n *= s
            t = slab[off:off + n * size].view(dtype).view(shape)
            if zero:
                t.zero_()
            self.tensors[name] = t
        self.nbytes = total
        tensors, self.tensors = self.tensors, {}  # the caller's (a released slab must not stay referenced here)
        return tensors

    def sizes(self) -> dict[str, int]:
        """Each declared buffer's bytes in the slab (aligned), allocated or not."""
        out = {}
        for name, shape, dtype, _ in self._specs:
            n = torch.empty((), dtype=dtype).element_size()
            for s in shape:
                n *= s
            out[name] = (n + SLAB_ALIGN - 1) // SLAB_ALIGN * SLAB_ALIGN
        return out


# ------------------------------------------------------------------------------------------
# Where a position is
# ------------------------------------------------------------------------------------------

def _slot_ptr(buf: torch.Tensor, i: int) -> int:
    """The address of buf[i] (without creating the view)."""
    return buf.data_ptr() + i * buf.stride(0) * buf.element_size()


class EagerPosition:
    """Position t with Python integers: saved tensors are views of their slot, keys are
    sliced to exactly t + 1 (self) and 1 + vis(t) (memory).

    Rows (model/fused_rows.py): the position runs on ``n`` of the run's ``batch`` rows. The
    per-position tensors are rows [:n] of their (B, .) buffers; the batch-major ones (K/V and
    their gradients, (B, ...) or (B h_kv, ...)) are indexed by physical row: rows [:n] when
    ``idx`` is None, else the rows ``idx`` (n,), gathered to read and index_add_-ed to write."""

    static = False

    def __init__(self, t: int, slot: int, ring: int, memory_block: int, cos, sin_fwd, sin_bwd,
                 rows: Optional[int] = None, batch: Optional[int] = None, idx: Optional[torch.Tensor] = None) -> None:
        self.t, self.slot, self.ring = t, slot, ring
        self.n_self = t + 1
        self.n_mem = 1 + memory_block * ((t + 1) // memory_block)  # the null slot + vis(t)
        self.cos, self.sin_fwd, self.sin_bwd = cos[t], sin_fwd[t], sin_bwd[t]
        self.self_mask = self.mem_mask = None
        self.batch = batch
        self.n = batch if rows is None else rows
        self.full = rows is None or rows == batch  # (then idx is None)
        self.idx = idx

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """A (B, ...) per-position tensor -> its active rows [:n]."""
        return x if self.full else x[:self.n]

    def batch_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A batch-major (B, ...) or (B h_kv, ...) tensor -> the active rows' (a view when they
        are a prefix, a gathered copy otherwise)."""
        if self.full:
            return x
        per = x.shape[0] // self.batch
        if self.idx is None:
            return x[:self.n * per]
        y = x.view(self.batch, per, *x.shape[1:]).index_select(0, self.idx)
        return y.view(self.n * per, *x.shape[1:])

    def add_rows(self, acc: torch.Tensor, value: torch.Tensor) -> None:
        """acc (B [h_kv], ...) batch-major (a view) += value over the active rows."""
        if self.idx is None:
            (acc if self.full else acc[:self.n * (acc.shape[0] // self.batch)]).add_(value)
            return
        per = acc.shape[0] // self.batch
        acc.view(self.batch, per, *acc.shape[1:]).index_add_(0, self.idx, value.view(self.n, per, *value.shape[1:]))

    def _slot(self, buf: torch.Tensor) -> int:
        """This position's slot of a slot buffer: a buffer of one slot (a tensor read only by
        this position's own backward, in a checkpointed run) has slot 0."""
        return self.slot if buf.shape[0] > 1 else 0

    def out(self, buf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Where to compute a saved tensor: its slot (None: not saved)."""
        return None if buf is None else self.rows(buf[self._slot(buf)])

    def out_ring(self, buf: torch.Tensor) -> torch.Tensor:
        return self.rows(buf[self.ring])

    def keep(self, buf: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
        """value, kept in its slot of ``buf`` (a no-op when computed there or not saved)."""
        if buf is not None:
            slot = self._slot(buf)
            if value.data_ptr() != _slot_ptr(buf, slot):
                self.rows(buf[slot]).copy_(value)
        return value

    def keep_ring(self, buf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if value.data_ptr() != _slot_ptr(buf, self.ring):
            self.rows(buf[self.ring]).copy_(value)
        return value

    def load(self, buf: torch.Tensor) -> torch.Tensor:
        return self.rows(buf[self._slot(buf)])

    def out_t(self, buf: torch.Tensor) -> torch.Tensor:  # the position-indexed buffers
        return self.rows(buf[self.t])

    def keep_t(self, buf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if value.data_ptr() != _slot_ptr(buf, self.t):
            self.rows(buf[self.t]).copy_(value)
        return value

    def load_t(self, buf: torch.Tensor) -> torch.Tensor:
        return self.rows(buf[self.t])

    def write_kv(self, kt: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """kt (B, h_kv, Dh, cap), v (B, h_kv, cap, Dh) <- this position's k, v (n, h_kv, Dh)."""
        if self.idx is None:
            self.rows(kt.select(3, self.t)).copy_(k_new)
            self.rows(v.select(2, self.t)).copy_(v_new)
        else:
            kt.select(3, self.t).index_copy_(0, self.idx, k_new)
            v.select(2, self.t).index_copy_(0, self.idx, v_new)

    def self_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kt (B h_kv, Dh, cap), v (B h_kv, cap, Dh) -> the keys and values attended to."""
        return self.batch_rows(kt[:, :, :self.n_self]), self.batch_rows(v[:, :self.n_self])

    def mem_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch_rows(kt[:, :, :self.n_mem]), self.batch_rows(v[:, :self.n_mem])

    def kv_grad(self, gkt: torch.Tensor, gv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This position's (complete) K/V gradients from the (B, h_kv, Dh, cap) and
        (B, h_kv, cap, Dh) accumulators: (n, h_kv, Dh) each."""
        return self.batch_rows(gkt.select(3, self.t)), self.batch_rows(gv.select(2, self.t))

    def put(self, buf: torch.Tensor, index: int, value: torch.Tensor) -> None:
        """buf[index] <- value (the input gradient of the stack: a position-indexed buffer)."""
        if value.data_ptr() != _slot_ptr(buf, index):
            self.rows(buf[index]).copy_(value)


class StaticPosition:
    """Position t as a 0-d long device tensor: every shape is the capacity's, so the step can be
    captured once and replayed for every t. After changing ``t`` (in place, on the device), call
    :meth:`update`: device operations only, so it is part of a captured step."""

    static = True

    def __init__(self, capacity: int, mem_capacity: int, slots: int, ring: int, memory_block: int,
                 cos, sin_fwd, sin_bwd, mask_dtype: torch.dtype, device: torch.device) -> None:
        self.slots_n, self.ring_n, self.C = slots, ring, memory_block
        self.tables = (cos, sin_fwd, sin_bwd)
        self.mask_dtype = mask_dtype
        self.t = torch.zeros((), dtype=torch.long, device=device)
        self.positions = torch.arange(capacity, device=device)
        self.mem_positions = torch.arange(mem_capacity, device=device)
        self.neg_inf = torch.tensor(float("-inf"), dtype=mask_dtype, device=device)
        self.zero = torch.zeros((), dtype=mask_dtype, device=device)
        self.update()

    def update(self) -> None:
        t = self.t
        self.t1 = t.view(1)
        self.slot = torch.remainder(t, self.slots_n).view(1)
        self.slot0 = torch.zeros(1, dtype=torch.long, device=t.device)  # the slot of a one-slot buffer
        self.ring = torch.remainder(t, self.ring_n).view(1)
        cos, sin_fwd, sin_bwd = self.tables
        self.cos = cos.index_select(0, self.t1)  # (1, Dh)
        self.sin_fwd = sin_fwd.index_select(0, self.t1)
        self.sin_bwd = sin_bwd.index_select(0, self.t1)
        visible = 1 + self.C * torch.div(t + 1, self.C, rounding_mode="floor")  # the null slot + vis(t)
        self.self_mask = torch.where(self.positions <= t, self.zero, self.neg_inf).view(1, 1, -1)
        self.mem_mask = torch.where(self.mem_positions < visible, self.zero, self.neg_inf).view(1, 1, -1)

    def out(self, buf: Optional[torch.Tensor]) -> None:
        return None

    def out_ring(self, buf: torch.Tensor) -> None:
        return None

    def _slot(self, buf: torch.Tensor) -> torch.Tensor:
        return self.slot if buf.shape[0] > 1 else self.slot0

    def keep(self, buf: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
        if buf is not None:
            buf.index_copy_(0, self._slot(buf), value.unsqueeze(0))
        return value

    def keep_ring(self, buf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        buf.index_copy_(0, self.ring, value.unsqueeze(0))
        return value

    def load(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.index_select(0, self._slot(buf)).squeeze(0)

    def out_t(self, buf: torch.Tensor) -> None:
        return None

    def keep_t(self, buf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        buf.index_copy_(0, self.t1, value.unsqueeze(0))
        return value

    def load_t(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.index_select(0, self.t1).squeeze(0)

    def write_kv(self, kt: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        kt.index_copy_(3, self.t1, k_new.unsqueeze(3))
        v.index_copy_(2, self.t1, v_new.unsqueeze(2))

    def self_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kt, v

    def mem_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kt, v

    def kv_grad(self, gkt: torch.Tensor, gv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gkt.index_select(3, self.t1).squeeze(3), gv.index_select(2, self.t1).squeeze(2)

    def put(self, buf: torch.Tensor, index, value: torch.Tensor) -> None:
        buf.index_copy_(0, self.t1, value.unsqueeze(0))
