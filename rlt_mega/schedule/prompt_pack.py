"""The learner's encoder with shared prefixes: each group's prefix encoded once, each row's
own tokens after it (docs/design.md, "The learner follows the data").

The dense schedule's encoder is causal, so in the padded layout the G rows of a group compute the
same encoder outputs over their prompt G times, and every row runs to the batch's longest. A
:class:`PromptPack` lays the batch out as one flat sequence instead (a batch of one row, so
every product runs over exactly the tokens it lists): per group, the prompt's P positions once,
then each member row's own positions [P, L_b) (L_b = ``DenseRows.lengths[b]``: the decoder of
row b reads the memory of positions s < vis(t) <= t + 1 for t < L_b, so nothing past L_b is
read). It computes the same function as the padded encoder at every position a row reads:

- RoPE positions are each token's position in its own row (the prompt 0..P-1, row b's own
  tokens P..L_b - 1);
- attention (``attention``): the prompt's queries see the prompt causally; a row's own queries
  see the whole prompt and their own row's earlier tokens, never another row's. Per group that
  is two fused attentions: the prompt's (causal), and the rows' (G rows of their own queries,
  padded to the longest, over [the prompt's keys; their own keys] under a mask).

``pack`` gathers the embeddings into that layout and ``unpack`` the encoder's output back to
(B, T, d), a prompt position's output read by every row of its group (so backward sums the G
rows' gradients into it, index_select's backward) and 0 at the positions no row reads. The
decoder then runs on the row layout as before. The object takes the place of a Documents in
``RLT.encode`` (``shape``, ``rope``, ``attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rlt_mega.model.layout import to_device

if TYPE_CHECKING:  # the rows build their pack (DenseRows.encoder_pack): no import at run time
    from rlt_mega.schedule.dense import DenseRows


@dataclass
class _Group:
    start: int  # the group's first packed position (its prompt's)
    P: int  # prompt positions
    own: torch.Tensor  # (G, n_max) long: packed positions of each row's own tokens (padded: start)
    mask: torch.Tensor  # (G, 1, n_max, P + n_max) bool: keys each own query sees
    valid: torch.Tensor  # flat indices into (G * n_max) of the real own queries, in packed order


class PromptPack:
    """The packed layout of a batch of B rows x T positions whose ``rows.groups`` share prompts."""

    def __init__(self, rows: DenseRows, T: int, device: torch.device) -> None:
        if rows.groups is None:
            raise ValueError("a prompt pack needs the rows' groups (DenseRows.groups)")
        B = rows.batch_size
        members: dict[int, list[int]] = {}
        for b, g in enumerate(rows.groups):
            if min(rows.lengths[b], T) > 0:
                members.setdefault(g, []).append(b)
        src: list[int] = []  # flat (b * T + t) row position of each packed position
        positions: list[int] = []
        unpack = [-1] * (B * T)
        self.groups: list[_Group] = []
        for bs in members.values():
            start, P = len(src), rows.prompt_lens[bs[0]]
            short = [b for b in bs if min(rows.lengths[b], T) < P]
            if short:  # L_b = P_b + n_b - 1 >= P_b for a row with a completion token
                raise ValueError(f"dense rows: row {short[0]} needs {rows.lengths[short[0]]} positions of a batch of "
                                 f"{T}, fewer than its prompt's {P}: build the rows from the batch's own rows")
            src += [bs[0] * T + t for t in range(P)]
            positions += range(P)
            own_lists = []
            for b in bs:
                for t in range(P):
                    unpack[b * T + t] = start + t
                own = list(range(len(src), len(src) + min(rows.lengths[b], T) - P))
                for t, j in zip(range(P, T), own):
                    unpack[b * T + t] = j
                src += [b * T + t for t in range(P, P + len(own))]
                positions += range(P, P + len(own))
                own_lists.append(own)
            self.groups.append(_group(start, P, own_lists, device))
        self.total = len(src)
        self.src = to_device(src, device)
        self.positions = to_device([positions], device)  # (1, total)
        # positions no row reads take the appended zero row (index total)
        self.unpack_index = to_device([self.total if j < 0 else j for j in unpack], device)
        self.B, self.T = B, T
        self._rope: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def shape(self) -> tuple[int, int]:
        return (1, self.total)

    def pack(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, d) in the row layout -> (1, total, d)."""
        B, T, d = h.shape
        return h.reshape(B * T, d).index_select(0, self.src).unsqueeze(0)

    def unpack(self, h: torch.Tensor) -> torch.Tensor:
        """(1, total, d) -> (B, T, d): each row's positions [0, L_b), 0 elsewhere."""
        flat = torch.cat([h[0], h.new_zeros(1, h.shape[-1])])
        return flat.index_select(0, self.unpack_index).view(self.B, self.T, -1)

    def rope(self, rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (1, 1, total, Dh), at each packed token's row position."""
        if dtype not in self._rope:
            self._rope[dtype] = rotary.rows(self.positions, dtype)
        return self._rope[dtype]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, h, total, Dh); k, v (1, h_kv, total, Dh) -> (1, h, total, Dh), each query over
        the keys of its own row (see the module docstring)."""
        gqa = q.shape[1] != k.shape[1]
        q, k, v = q[0], k[0], v[0]
        pieces = []
        for g in self.groups:
            span = slice(g.start, g.start + g.P)
            qp, kp, vp = q[:, span], k[:, span], v[:, span]  # (h, P, Dh)
            pieces.append(F.scaled_dot_product_attention(qp[None], kp[None], vp[None], is_causal=True,
                                                         enable_gqa=gqa)[0].transpose(0, 1))  # (P, h, Dh)
            if not g.valid.numel():
                continue
            G, n = g.own.shape
            idx = g.own.reshape(-1)

            def rows_of(x: torch.Tensor) -> torch.Tensor:  # (h, total, Dh) -> (G, h, n, Dh)
                return x.index_select(1, idx).view(x.shape[0], G, n, -1).transpose(0, 1)

            keys = torch.cat([kp[None].expand(G, -1, -1, -1), rows_of(k)], dim=2)
            values = torch.cat([vp[None].expand(G, -1, -1, -1), rows_of(v)], dim=2)
            out = F.scaled_dot_product_attention(rows_of(q), keys, values, attn_mask=g.mask, enable_gqa=gqa)
            pieces.append(out.transpose(1, 2).reshape(G * n, q.shape[0], -1).index_select(0, g.valid))
        return torch.cat(pieces).transpose(0, 1).unsqueeze(0)


def _group(start: int, P: int, own: list[list[int]], device: torch.device) -> _Group:
    """A group's own-token queries: (G, n_max) packed positions (padding repeats ``start``, the
    prompt's first position: its output is dropped) and their key mask over [prompt; own]: every
    prompt key, and the own keys j <= i of a real query (a padding query sees the prompt only)."""
    G, n = len(own), max(map(len, own))
    positions = torch.tensor([o + [start] * (n - len(o)) for o in own], dtype=torch.long)
    lens = torch.tensor([len(o) for o in own])
    i = torch.arange(n)
    real = i[None, :] < lens[:, None]  # (G, n)
    own_keys = (i[None, :, None] >= i[None, None, :]) & real[:, :, None] & real[:, None, :]  # (G, n, n)
    mask = torch.cat([torch.ones(G, n, P, dtype=torch.bool), own_keys], dim=2)[:, None]
    valid = torch.nonzero(real.reshape(-1)).squeeze(1)
    return _Group(start, P, positions.to(device), mask.to(device), valid.to(device))
