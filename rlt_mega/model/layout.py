"""Where the rows of one decoder step are: the row layout the one decoder step (model/decoder.py)
reads, in every schedule.

A step runs ``n`` of a run's ``batch`` rows (physical rows [:n], or the rows ``idx``). Each row has

- its RoPE position (``cos``/``sin`` of one position (Dh,), or one row each (n, 1, Dh));
- the column of the decoder K/V its key and value go to (``col``: the step index t, or a (n,)
  tensor, one column per row);
- the keys it attends to: the decoder's columns [0, n_self) and the memory slots [0, n_mem) (slot
  0 the null memory), each with an additive mask (n h_kv, 1, S) where rows differ (None: every
  key of the range is visible to every row);
- whether its recurrent state restarts from z_init before the step (``reset``, packed documents).

So the schedules are layouts, not code paths:

- the dense schedule: every row at position t (``Step.at``), or only the rows a batch needs
  there (``rows``/``idx``: schedule/dense.py);
- packed rows with document resets (``Step.documents``): column t, each row's RoPE position its
  document's, keys and memory of its own document only, z reset at a document's first position;
- the rollout and replay with rows at their own positions (``Step.rows``): column and RoPE
  position per row, keys [0, its position] and memory [0, 1 + vis(its position)) per row.

The saved-activation methods (``out``, ``keep``, ``load``, ...) say where a training step keeps
what its backward reads: per activation slot, per weight-gradient ring slot (``*_ring``), per
position t (``put``); a no-grad step keeps nothing.

:class:`StaticStep` is the capture-ready form: t a 0-d device tensor, every shape the capacity's,
writes by ``index_copy_`` and reads by ``index_select``, masks built on the device, so one step can
be captured once and replayed for every t.
"""

from __future__ import annotations

from typing import Optional, Union

import torch


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (a list, nested lists or a CPU tensor) -> a tensor on ``device`` without a host
    sync: on CUDA through pinned memory with a non-blocking copy (the caching host allocator keeps
    the pinned block until the copy is done), since a pageable copy blocks the host until the
    stream drains. Every index tensor a schedule event builds comes through here."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _slot_ptr(buf: torch.Tensor, i: int) -> int:
    """The address of buf[i] (without creating the view)."""
    return buf.data_ptr() + i * buf.stride(0) * buf.element_size()


def additive(hidden: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """hidden (n, S) bool, True where a row must not look -> the additive mask (n h_kv, 1, S) of
    ``kernels.attend`` (0 or -inf), one copy per key/value head."""
    n, S = hidden.shape
    mask = torch.zeros(n, S, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
    return mask[:, None, None, :].expand(n, num_kv_heads, 1, S).reshape(n * num_kv_heads, 1, S)


class Step:
    """One decoder step, eager: Python integers for t and the key ranges (no host reads).

    t: the step's index in the run (the position-indexed buffers); slot, ring: its activation
    slot and weight-gradient ring slot. batch: the run's rows; rows: the n rows this step runs
    (None: all); idx: which physical rows (None: the prefix [:n]). See the module docstring for
    the rest."""

    static = False

    def __init__(self, t: int, slot: int, ring: int, cos: torch.Tensor, sin_fwd: torch.Tensor,
                 sin_bwd: Optional[torch.Tensor], n_self: int, n_mem: int, *, batch: int,
                 rows: Optional[int] = None, idx: Optional[torch.Tensor] = None,
                 col: Union[int, torch.Tensor, None] = None, self_mask: Optional[torch.Tensor] = None,
                 mem_mask: Optional[torch.Tensor] = None, reset: Optional[torch.Tensor] = None) -> None:
        self.t, self.slot, self.ring = t, slot, ring
        self.cos, self.sin_fwd, self.sin_bwd = cos, sin_fwd, sin_bwd
        self.n_self, self.n_mem = n_self, n_mem
        self.batch = batch
        self.n = batch if rows is None else rows
        self.full = rows is None or rows == batch  # (then idx is None)
        self.idx = idx
        self.col = t if col is None else col
        self.self_mask, self.mem_mask, self.reset = self_mask, mem_mask, reset

    # ------------------------------------------------------------------ the layouts
    @classmethod
    def at(cls, t: int, tables, memory_block: int, *, batch: int, slot: int = 0, ring: int = 0,
           rows: Optional[int] = None, idx: Optional[torch.Tensor] = None) -> "Step":
        """Every row (or the rows given) at position t: keys [0, t], memory [0, 1 + vis(t))."""
        cos, sin_fwd, sin_bwd = tables
        return cls(t, slot, ring, cos[t], sin_fwd[t], None if sin_bwd is None else sin_bwd[t], t + 1,
                   1 + memory_block * ((t + 1) // memory_block), batch=batch, rows=rows, idx=idx)

    @classmethod
    def rows(cls, k: int, pos: torch.Tensor, num_keys: int, tables, memory_block: int, num_kv_heads: int,
             dtype: torch.dtype, *, batch: int) -> "Step":
        """Step k of the row schedule: row b of the prefix [:n] (n = len(pos)) of ``batch`` rows at
        position pos[b] ((n,) long on the device), writing its K/V at column pos[b] and seeing its
        keys [0, pos[b]] and memory slots [0, 1 + vis(pos[b])); ``num_keys`` (a host int from the
        plan) bounds the positions over the batch. No backward (the rollout and replay run no grad)."""
        C = memory_block
        cos, sin_fwd, _ = tables
        num_slots = 1 + C * (num_keys // C)  # the null slot + vis of the furthest row
        visible = 1 + C * torch.div(pos + 1, C, rounding_mode="floor")  # (n,)
        hide_keys = torch.arange(num_keys, device=pos.device)[None, :] > pos[:, None]
        hide_slots = torch.arange(num_slots, device=pos.device)[None, :] >= visible[:, None]
        return cls(k, 0, 0, cos.index_select(0, pos)[:, None], sin_fwd.index_select(0, pos)[:, None], None,
                   num_keys, num_slots, batch=batch, rows=len(pos), col=pos,
                   self_mask=additive(hide_keys, num_kv_heads, dtype),
                   mem_mask=additive(hide_slots, num_kv_heads, dtype))

    @classmethod
    def documents(cls, t: int, docs, tables, memory_block: int, num_kv_heads: int, dtype: torch.dtype, *,
                  batch: int, slot: int, ring: int) -> "Step":
        """Position t of rows packed with documents (model/documents.py): column t, RoPE at each
        row's position in its document, the keys and memory slots of its own document (the memory
        of positions < vis of its document position, counted from the document's start), z reset
        where a document starts at t."""
        cos, sin_fwd, sin_bwd = docs.rope_rows(tables, t)  # (B, 1, Dh) each
        n_mem = min(2 + t, 1 + docs.shape[1])  # the null slot and positions <= t: a document's memory never runs ahead
        self_hidden = ~docs.attend[:, t, :t + 1]
        mem_hidden = ~docs.memory(memory_block)[:, t, :n_mem]
        return cls(t, slot, ring, cos, sin_fwd, sin_bwd, t + 1, n_mem, batch=batch,
                   self_mask=additive(self_hidden, num_kv_heads, dtype),
                   mem_mask=additive(mem_hidden, num_kv_heads, dtype),
                   reset=docs.starts[:, t] if t > 0 else None)

    # ------------------------------------------------------------------ rows
    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """A (B, ...) per-step tensor -> its active rows [:n]."""
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

    # ------------------------------------------------------------------ saved tensors
    def _slot(self, buf: torch.Tensor) -> int:
        """This step's slot of a slot buffer: a buffer of one slot (a tensor read only by this
        step's own backward, in a checkpointed run) has slot 0."""
        return self.slot if buf.shape[0] > 1 else 0

    def out(self, buf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Where to compute a saved tensor: its slot (None: not saved)."""
        return None if buf is None else self.rows_of(buf[self._slot(buf)])

    def out_ring(self, buf: torch.Tensor) -> torch.Tensor:
        return self.rows_of(buf[self.ring])

    def keep(self, buf: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
        """value, kept in its slot of ``buf`` (a no-op when computed there or not saved)."""
        if buf is not None:
            slot = self._slot(buf)
            if value.data_ptr() != _slot_ptr(buf, slot):
                self.rows_of(buf[slot]).copy_(value)
        return value

    def keep_ring(self, buf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if value.data_ptr() != _slot_ptr(buf, self.ring):
            self.rows_of(buf[self.ring]).copy_(value)
        return value

    def load(self, buf: torch.Tensor) -> torch.Tensor:
        return self.rows_of(buf[self._slot(buf)])

    def put(self, buf: torch.Tensor, index: int, value: torch.Tensor) -> None:
        """buf[index] <- value (the input gradient of the stack: a position-indexed buffer)."""
        if value.data_ptr() != _slot_ptr(buf, index):
            self.rows_of(buf[index]).copy_(value)

    # ------------------------------------------------------------------ keys and values
    def write_kv(self, kt: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """kt (B, h_kv, Dh, cap), v (B, h_kv, cap, Dh) <- this step's k, v (n, h_kv, Dh), at each
        row's column."""
        if isinstance(self.col, torch.Tensor):  # a column per row (the prefix [:n])
            rows = torch.arange(self.n, device=k_new.device)
            kt[rows, :, :, self.col] = k_new
            v[rows, :, self.col] = v_new
        elif self.idx is None:
            self.rows_of(kt.select(3, self.col)).copy_(k_new)
            self.rows_of(v.select(2, self.col)).copy_(v_new)
        else:
            kt.select(3, self.col).index_copy_(0, self.idx, k_new)
            v.select(2, self.col).index_copy_(0, self.idx, v_new)

    def self_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kt (B h_kv, Dh, cap), v (B h_kv, cap, Dh) -> the keys and values attended to."""
        return self.batch_rows(kt[:, :, :self.n_self]), self.batch_rows(v[:, :self.n_self])

    def mem_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch_rows(kt[:, :, :self.n_mem]), self.batch_rows(v[:, :self.n_mem])

    def kv_grad(self, gkt: torch.Tensor, gv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (complete) K/V gradients from the (B, h_kv, Dh, cap) and (B, h_kv, cap, Dh)
        accumulators: (n, h_kv, Dh) each."""
        return self.batch_rows(gkt.select(3, self.col)), self.batch_rows(gv.select(2, self.col))


class StaticStep:
    """Position t as a 0-d long device tensor: every shape is the capacity's, so the step can be
    captured once and replayed for every t. After changing ``t`` (in place, on the device), call
    :meth:`update`: device operations only, so it is part of a captured step. Every row runs."""

    static = True
    reset = None

    def __init__(self, capacity: int, mem_capacity: int, slots: int, ring: int, memory_block: int, tables,
                 mask_dtype: torch.dtype, device: torch.device, batch: int) -> None:
        self.slots_n, self.ring_n, self.C = slots, ring, memory_block
        self.tables = tables
        self.n = batch
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

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        return x

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

    def put(self, buf: torch.Tensor, index, value: torch.Tensor) -> None:
        buf.index_copy_(0, self.t1, value.unsqueeze(0))

    def write_kv(self, kt: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        kt.index_copy_(3, self.t1, k_new.unsqueeze(3))
        v.index_copy_(2, self.t1, v_new.unsqueeze(2))

    def self_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kt, v

    def mem_keys(self, kt: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kt, v

    def kv_grad(self, gkt: torch.Tensor, gv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gkt.index_select(3, self.t1).squeeze(3), gv.index_select(2, self.t1).squeeze(2)
