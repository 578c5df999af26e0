"""How a sampler on one rank talks to the rest of its model replica (docs/design.md, "GRPO": it is
colocated, each data-parallel replica samples with its learner's TP/PP layout).

- pipeline: point-to-point messages between the stages of the replica's pipeline (the
  training ring's ``P2P``, parallel/p2p.py: one channel per direction, blocking receives,
  non-blocking sends, a message to oneself through a local queue, so one stage closes the ring
  on itself);
- tensor parallel: ``gather_vocab`` makes a vocab shard of logits whole on every TP rank, and
  ``share_tokens`` makes every TP rank continue with TP rank 0's tokens;
- ``share_results`` hands what the last stage knows (the finished rollouts) to every stage.

A sampler never talks across data-parallel replicas: each samples its own prompts, for as many
positions as they need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rlt_mega.parallel.p2p import P2P


@dataclass
class Comms:
    p2p: P2P
    num_stages: int
    stage: int
    tp: int = 1
    tp_group: Any = None
    tp_src: int = 0  # global rank of TP rank 0 in my TP group
    pp_group: Any = None
    last_stage_rank: int = 0  # global rank of my pipeline's last stage (same TP rank)
    gather_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @classmethod
    def local(cls, device: torch.device | str = "cpu") -> "Comms":
        """One process holds the whole model."""
        return cls(P2P([0], 0, torch.device(device)), num_stages=1, stage=0)

    @classmethod
    def from_dims(cls, dims) -> "Comms":
        """The replica of ``dims`` (parallel.dims.ParallelDims): my stage, my TP group."""
        from rlt_mega.parallel.tp import gather_vocab

        return cls(P2P.for_pipeline(dims), num_stages=dims.pp, stage=dims.pp_rank,
                   tp=dims.tp, tp_group=dims.tp_group, tp_src=dims.rank - dims.tp_rank, pp_group=dims.pp_group,
                   last_stage_rank=dims.pp_ranks[-1], gather_fn=lambda x: gather_vocab(x, dims))

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V / tp) -> (B, V): the same full rows on every TP rank (an all-gather, exact)."""
        return logits if self.tp == 1 else self.gather_fn(logits)

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every TP rank draws from the same full rows with the same generators, so the draws
        agree wherever the kernels are deterministic; the next inputs must agree everywhere, so
        TP rank 0's tokens (B,) are broadcast (B integers per step: cheap insurance)."""
        if self.tp > 1:
            tokens = tokens.contiguous()
            dist.broadcast(tokens, src=self.tp_src, group=self.tp_group)
        return tokens

    def once_in_tp(self, fn: Callable[[], Any]) -> Any:
        """fn() run on TP rank 0 only (an environment's responses: host work that need not be
        deterministic, e.g. under a time limit) and its picklable result handed to every TP rank."""
        if self.tp == 1:
            return fn()
        box = [fn() if dist.get_rank() == self.tp_src else None]
        dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
        return box[0]

    def share_results(self, obj: Any) -> Any:
        """The last stage's ``obj`` (picklable, CPU tensors) on every stage of the pipeline."""
        if self.num_stages == 1:
            return obj
        box = [obj if self.is_last_stage else None]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pp_group)
        return box[0]
