"""Which rows each position of the fused dense decoder runs on (the learner's side of the row
schedule; docs/design.md, "The learner follows the data").

A batch is B rows of different lengths, and the rows of a group share their prefix. The padded
dense schedule runs every position on all B rows; a :class:`DensePlan` tells a
model/decoder.py's DecoderRun, position by position, which rows are *active*. It is the sampler's row
plan (schedule/rows.py ``RowPlan``, one slot a sequence, so step k is position k) run over the batch,
with each entry (a shared prefix) run by one of its rows:

- compaction: row b needs positions [0, L_b) only (``L_b = P_b + n_b - 1``: the last position
  whose logits the loss reads); past it the row leaves (the plan's length rule).
- shared prefixes: the rows of a group see the same tokens at positions [0, p) (p their prefix
  length), so they have the same state there. One row of the group (its representative, the
  longest) runs the entry's positions; at t = p the group forks (the plan's ``Fork``): the other
  rows' decoder K/V of [0, p) are copied from the representative's (``KVCopy``) and their
  z_{p-1} is the representative's (the representative's output at t < p is every group row's
  output, so the input of position p is already the right one). Backward, the G rows' gradients
  of that K/V history and of those outputs sum into the representative's.

Row order. The run keeps its per-row (batch-major) buffers in a *physical* order: the rows sorted
by L descending (ties in caller order). With compaction alone the active rows at t are then a
prefix ``[:n_t]`` of it, and the step runs on contiguous views of its buffers. With shared
prompts the active set at t is {the representative of each group with t < p} U {the live rows
of forked groups}: rows join at their fork and leave at their end, so no fixed order keeps every
such set a prefix (it would need nested intervals). Those positions (only before the last fork)
run on the active rows given by index (``RowStep.idx``): the K/V they attend to are gathered
(index_select) and their K/V gradients added by index_add_; every position at and after the
last fork is a prefix again. The per-position tensors (inputs, saved activations, output
gradients) are always compact: rows [:n_t] of each (B, .) buffer in the order of the active
rows, so the deferred weight-gradient GEMMs stay one GEMM over all B rows per chunk (rows past
n_t hold zero output gradients and contribute exactly nothing).

The caller (the dense Function, a pipeline stage) keeps its own row order: a run maps x, e and
the output gradient in (``RowStep.caller``) and y and the input gradient out, dead rows 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from rlt_mega.loss import DENSE_ROWS  # noqa: F401 (the batch dict's key of a DenseRows)
from rlt_mega.model.documents import Documents
from rlt_mega.model.layout import to_device
from rlt_mega.schedule import rows as schedule
from rlt_mega.schedule.prompt_pack import PromptPack


@dataclass(frozen=True)
class DenseRows:
    """What the learner knows of a batch's rows (host lists, B each): ``lengths[b]`` positions
    row b needs (0: none), ``prompt_lens[b]``, and ``groups[b]`` the id of the rows sharing
    row b's prompt (None: no sharing). ``compact`` False: every row runs every position (then
    only the sharing, if any, removes rows). Rides in the batch dict as ``dense_rows``."""

    lengths: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    groups: Optional[tuple[int, ...]] = None
    compact: bool = True

    def __post_init__(self) -> None:
        B = len(self.lengths)
        if len(self.prompt_lens) != B or (self.groups is not None and len(self.groups) != B):
            raise ValueError(f"dense rows: lengths ({B}), prompt_lens ({len(self.prompt_lens)}) and groups "
                             f"({None if self.groups is None else len(self.groups)}) must have one entry a row")
        if self.groups is not None:
            seen: dict[int, int] = {}
            for b, g in enumerate(self.groups):
                if seen.setdefault(g, self.prompt_lens[b]) != self.prompt_lens[b]:
                    raise ValueError(f"dense rows: group {g} has prompts of lengths {seen[g]} and "
                                     f"{self.prompt_lens[b]}: rows share a prompt only if it is the same")

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def read_index(self, T: int, device: torch.device) -> torch.Tensor:
        """The positions whose logits the loss reads, flat (b * T + t), in row-major order: row
        b's [P_b - 1, lengths_b) (the logits at P_b - 1 score the first completion token, those
        at lengths_b - 1 the last)."""
        spans = [torch.arange(b * T + max(p - 1, 0), b * T + min(n, T)) for b, (p, n) in
                 enumerate(zip(self.prompt_lens, self.lengths)) if n > 0]
        return (torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)).to(device)

    def head(self, head, z: torch.Tensor) -> torch.Tensor:
        """``head(z)`` (z (B, T, d) -> logits (B, T, V)) computed at the positions the loss
        reads only (``read_index``; 0 elsewhere) when ``compact``: the prompt and padding
        positions are most of a learner's batch, and the head (a d x V GEMM and its gradients) is
        the learner's largest product after the decoder. Without compaction every position."""
        if not self.compact:
            return head(z)
        B, T, d = z.shape
        idx = self.read_index(T, z.device)
        picked = head(z.reshape(B * T, d).index_select(0, idx))  # (M, V)
        return picked.new_zeros(B * T, picked.shape[-1]).index_copy(0, idx, picked).view(B, T, -1)

    def encoder_pack(self, T: int, device: torch.device,
                     documents: Optional[Documents] = None) -> Optional[PromptPack]:
        """The encoder's layout of a batch with shared prefixes (schedule/prompt_pack.py); None
        without groups (every row encoded whole) or for packed documents (their own layout)."""
        if documents is not None or self.groups is None:
            return None
        return PromptPack(self, T, device)

    def plan(self, B: int, T: int, device: torch.device) -> "DensePlan":
        """The DensePlan of these rows for a run of B x T (the model's decoder reads it)."""
        if self.batch_size != B:
            raise ValueError(f"dense rows describe {self.batch_size} rows, the batch has {B}: build them from the "
                             "batch's own rows")
        return DensePlan(self, T, device)



def stack_rows(parts: Sequence[Optional[DenseRows]]) -> Optional[DenseRows]:
    """The DenseRows of row-stacked batches (group ids kept apart per part)."""
    if not parts or any(p is None for p in parts):
        return None
    lengths, prompts, groups, offset = [], [], [], 0
    share = all(p.groups is not None for p in parts)
    for p in parts:
        lengths += p.lengths
        prompts += p.prompt_lens
        if share:
            groups += [offset + g for g in p.groups]
            offset += max(p.groups, default=-1) + 1
    return DenseRows(tuple(lengths), tuple(prompts), tuple(groups) if share else None,
                     all(p.compact for p in parts))


@dataclass
class KVCopy:
    """At t = p: the representative's decoder K/V of [0, p) into the other rows (physical)."""

    p: int
    rep: int
    others: torch.Tensor  # (k,) long, physical rows


@dataclass
class RowStep:
    """Position t's rows. n active rows: physical rows [:n] (idx None) or idx (n,) long;
    caller (n,): their rows in the caller's order; out_src (B,): for each caller row, which
    compact row its output is (n: none, the row is dead at t); readers (n, B) 0/1, where some
    compact row is the output of several caller rows (a group's representative before its
    fork): the output gradient of the compact rows is readers @ gy."""

    n: int
    idx: Optional[torch.Tensor]
    caller: torch.Tensor
    out_src: torch.Tensor
    readers: Optional[torch.Tensor] = None
    forks: list[KVCopy] = field(default_factory=list)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, d) in the caller's order -> the active rows (n, d)."""
        return x.index_select(0, self.caller)

    def outputs(self, y: torch.Tensor) -> torch.Tensor:
        """y (n, d) of the active rows -> (B, d) in the caller's order (dead rows 0)."""
        padded = torch.cat([y, y.new_zeros(1, y.shape[1])])
        return padded.index_select(0, self.out_src)

    def output_grads(self, gy: torch.Tensor) -> torch.Tensor:
        """gy (B, d), the gradient of ``outputs`` -> that of y (n, d)."""
        if self.readers is None:
            return gy.index_select(0, self.caller)
        return torch.mm(self.readers.to(gy.dtype), gy)

    def input_grads(self, gx: torch.Tensor) -> torch.Tensor:
        """gx (n, d), the gradient of ``gather(x)`` -> that of x (B, d)."""
        return gx.new_zeros(self.out_src.shape[0], gx.shape[1]).index_copy_(0, self.caller, gx)


def _kv_copies(log: list, layout, rep: dict[int, int], phys: dict[int, int], T: int,
               device: torch.device) -> dict[int, list[KVCopy]]:
    """Position -> the K/V copies of the forks there: each entry's representative into the other
    rows of its group that have work past the fork."""
    forks: dict[int, list[KVCopy]] = {}
    for e in log:
        if isinstance(e, schedule.Fork) and e.step + 1 < T:
            r = rep[e.entry]
            others = [phys[b] for b in e.rows if b != r and layout.last_position(b) >= layout.prompt_lens[b]]
            if others:
                forks.setdefault(e.step + 1, []).append(KVCopy(e.step + 1, phys[r], to_device(others, device)))
    return forks


class DensePlan:
    """The rows of every position [0, T) of a run of B rows (see the module docstring).

    ``perm`` (B,): the caller row at each physical row; ``step(t)`` None where position t runs
    on all B rows in the caller's order (nothing to map)."""

    def __init__(self, rows: DenseRows, T: int, device: torch.device) -> None:
        B = rows.batch_size
        # without compaction every row runs every position (the sharing may still remove rows)
        L = [min(int(x), T) for x in rows.lengths] if rows.compact else [T] * B
        order = sorted(range(B), key=lambda b: (-L[b], b))
        phys = {b: j for j, b in enumerate(order)}
        ids = None if rows.groups is None else [g if L[b] > 0 else ("alone", b) for b, g in enumerate(rows.groups)]
        layout = schedule.row_layout([[0] * p for p in rows.prompt_lens], 1, 1, None, share_prompts=ids is not None,
                                     compact=True, check_every=1, groups=ids, lengths=L)
        # each entry's representative: its longest row (first in the physical order)
        rep = {B + u: min(members, key=phys.get) for u, members in enumerate(layout.entry_rows)}
        reader_until, rep_of = [0] * B, list(range(B))
        for s, r in rep.items():
            for b in layout.entry_rows[s - B]:
                if b != r:  # outputs [0, min(p, L_b)) are the representative's
                    reader_until[b], rep_of[b] = min(rows.prompt_lens[b], L[b]), r
        plan, active_at = schedule.RowPlan(layout, schedule.planned_record(layout, lambda b: T + 1)), []
        while (sp := plan.begin(len(active_at))) is not None:
            active_at.append(sorted(phys[rep.get(s, s)] for s in sp.seqs))
        forks = _kv_copies(plan.log, layout, rep, phys, T, device)
        self.B, self.T, self.device = B, T, device
        self.perm = to_device(order, device)
        self.inverse = to_device([phys[b] for b in range(B)], device)
        self.identity = order == list(range(B))
        self.steps: list[Optional[RowStep]] = []
        self.active = 0  # row-positions the plan runs (B * T without it)
        for t in range(T):
            active = active_at[t] if t < len(active_at) else []
            n = len(active)
            self.active += n
            prefix = active == list(range(n))
            readers = [b for b in range(B) if t < reader_until[b]]
            if n == B and self.identity and not readers and t not in forks:
                self.steps.append(None)
                continue
            compact = {order[j]: k for k, j in enumerate(active)}
            out_src = [compact.get(b, compact.get(rep_of[b], n) if t < reader_until[b] else n) for b in range(B)]
            src = torch.tensor(out_src)
            reader_matrix = None
            if readers:  # (n, B): reader_matrix[k, b] = 1 where caller row b's output is compact row k
                reader_matrix = torch.zeros(n + 1, B)
                reader_matrix[src, torch.arange(B)] = 1.0
                reader_matrix = to_device(reader_matrix[:n], device)
            self.steps.append(RowStep(n, None if prefix else to_device(active, device),
                                      to_device([order[j] for j in active], device),
                                      to_device(src, device), reader_matrix, forks.get(t, [])))

    def step(self, t: int) -> Optional[RowStep]:
        return self.steps[t] if t < len(self.steps) else None

    def to_physical(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) in the caller's order -> in the physical order."""
        return x if self.identity else x.index_select(0, self.perm)

    def to_caller(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) in the physical order -> in the caller's order."""
        return x if self.identity else x.index_select(0, self.inverse)
