"""Reading what DeepSpeed holds: the full gradients and fp32 master weights of this rank's
parameters, through DeepSpeed's own accessors where it offers them (``safe_get_full_grad``,
``safe_get_full_fp32_param``) and through the one optimizer that it does not cover
(FP16_UnfusedOptimizer, bf16 without ZeRO), and the whole single-device state dict
gathered from every rank (checkpoints consolidate it; the tests compare it).

And the layout-free state (reshard.py) in and out of whichever optimizer DeepSpeed runs:
:meth:`DeepSpeedState.save_layout_free` writes every parameter's fp32 master and Adam moments
(this rank's TP slice, complete over the data-parallel group), :meth:`load_layout_free` puts
the slices of another layout's checkpoint into this one's ZeRO partitions, fp32 masters and
low-precision weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.gather import gather_tp
from rlt_mega.parallel.reshard import KEYS, LayoutFreeState, StateWriter, iter_owned
from rlt_mega.parallel.zero import pipeline_replicas


class DeepSpeedState:
    """``ds``: the DeepSpeed engine; ``zero_stage`` and ``bf16`` say which optimizer it runs."""

    def __init__(self, ds, dims: ParallelDims, zero_stage: int, bf16: bool) -> None:
        self.ds, self.dims, self.zero_stage, self.bf16 = ds, dims, zero_stage, bf16
        # Adam's step count before any update: FP16_UnfusedOptimizer (bf16 without ZeRO) takes
        # one empty step at initialisation, the others none. The layout-free state records
        # updates applied (the count minus this), so that it moves between optimizers.
        self.step_offset = self.adam_count()

    @property
    def _through_deepspeed(self) -> bool:
        """DeepSpeed keeps the gradient / fp32 master apart from the module's parameter."""
        return self.zero_stage > 0 or self.bf16

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter gradient after a backward (complete over the
        data-parallel partitions)."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.ds.module.named_parameters():
            g = safe_get_full_grad(p) if self._through_deepspeed else p.grad
            if g is not None:
                out[name] = g.detach().float().clone()
        return out

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter: the fp32 master weights where DeepSpeed keeps
        them (a collective over the data-parallel group under ZeRO-3: call on every rank)."""
        from deepspeed.utils import safe_get_full_fp32_param

        masters = self._unfused_masters()
        out = {}
        for name, p in self.ds.module.named_parameters():
            if id(p) in masters:
                out[name] = masters[id(p)].detach().clone()
            elif self._through_deepspeed:
                out[name] = safe_get_full_fp32_param(p).detach().clone()
            else:
                out[name] = p.detach().clone()
        return out

    def _unfused_groups(self) -> Optional[tuple[list, list]]:
        """bf16 without ZeRO runs DeepSpeed's FP16_UnfusedOptimizer: full fp32 masters
        (``fp32_groups``) parallel to the model's parameters (``fp16_groups``), which
        safe_get_full_fp32_param does not see. None for every other optimizer."""
        opt = self.ds.optimizer
        if self.zero_stage > 0 or not (hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups")):
            return None
        return opt.fp16_groups, opt.fp32_groups

    def _unfused_masters(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its fp32 master under FP16_UnfusedOptimizer (empty otherwise)."""
        groups = self._unfused_groups()
        if groups is None:
            return {}
        return {id(p): m for g16, g32 in zip(*groups) for p, m in zip(g16, g32)}

    def master_group_names(self) -> Optional[list[list[str]]]:
        """The names of FP16_UnfusedOptimizer's master groups, in its order (saved with the
        checkpoint: its ``fp32_groups`` are lists without names); None for other optimizers."""
        groups = self._unfused_groups()
        if groups is None:
            return None
        names = {id(p): n for n, p in self.ds.module.named_parameters()}
        return [[names[id(p)] for p in g16] for g16 in groups[0]]

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The single-device state dict (fp32, CPU) on global rank 0, None elsewhere. Collective:
        every rank calls it."""
        local = self.parameters_fp32()
        if self.dims.dp_rank != 0:
            return None
        full = gather_tp(local, self.dims)
        if self.dims.tp_rank != 0:
            return None
        return gather_pp_to_first({k: v.cpu() for k, v in full.items()}, self.dims)


    # ------------------------------------------------------------------ the layout-free state
    @property
    def _adam(self) -> torch.optim.Optimizer:
        """The torch AdamW under DeepSpeed's optimizer wrapper (or the optimizer itself)."""
        opt = self.ds.optimizer
        return getattr(opt, "optimizer", opt)

    def adam_count(self) -> int:
        steps = [int(v["step"]) for v in self._adam.state.values() if "step" in v]
        return max(steps) if steps else 0

    def _trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.ds.module.named_parameters() if p.requires_grad]

    def _replicas(self) -> set:
        """Pipeline replicas this stage does not write (the first stage's copy is the state)."""
        if self.dims.is_first_stage:
            return set()
        return set(pipeline_replicas(self.ds.module, self.dims))

    def _values(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """fp32 master and Adam moments of this rank's TP slice of ``p`` (complete over the
        data-parallel group: a collective under ZeRO and the bf16 optimizer)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        masters = self._unfused_masters()
        if id(p) in masters:
            master = masters[id(p)]
            state = self._adam.state.get(master, {})
            return {"fp32": master, **{k: state.get(k, torch.zeros_like(master)) for k in KEYS[1:]}}
        if self._through_deepspeed:
            out = {"fp32": safe_get_full_fp32_param(p)}
            started = len(self._adam.state) > 0  # no moments before the first update
            for k in KEYS[1:]:
                out[k] = safe_get_full_optimizer_state(p, k) if started else torch.zeros_like(out["fp32"])
            return out
        state = self._adam.state.get(p, {})
        return {"fp32": p.detach(), **{k: state.get(k, torch.zeros_like(p)) for k in KEYS[1:]}}

    def save_layout_free(self, directory: Path, steps_taken: int) -> None:
        """Writes this rank's part of the layout-free state into ``directory``/state/ (every rank
        calls it: the reads are collectives)."""
        d = self.dims
        opt = self.ds.optimizer
        if self._adam.state and hasattr(opt, "_hp_optimizer_states_linked"):
            # DeepSpeed links each parameter's view of the Adam state once, at its first step,
            # to whatever the state held then: linked again to what it holds now.
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        writer = StateWriter(directory, d.mp_rank, d.dp_rank, d.tp, d.tp_rank,
                             {"adam_step": self.adam_count() - self.step_offset, "steps_taken": steps_taken})
        for name, p, mine in iter_owned(self._trained(), self._replicas(), d.tp_rank, d.dp_rank, d.dp):
            values = self._values(p)
            if mine:
                writer.add(name, values)
        writer.close()

    def load_layout_free(self, state: LayoutFreeState) -> None:
        """Sets every trained parameter's fp32 master, Adam moments and step, and the weights the
        model computes with, from ``state``'s slices for this rank's layout."""
        d, tied = self.dims, bool(getattr(self.ds.module.cfg, "tie_embeddings", False))
        step = state.adam_step + self.step_offset
        self._start_adam(step)
        masters = self._unfused_masters()
        for name, p in self._trained():
            stored = state.lookup(name, tied)
            values = {k: self._read_once(state, stored, k).to(self.dims.device) for k in KEYS}
            shape = tuple(p.ds_shape) if hasattr(p, "ds_id") else tuple(p.shape)
            if tuple(values["fp32"].shape) != shape:
                raise CheckpointError(f"checkpoint {state.directory}: '{name}' is {tuple(values['fp32'].shape)} in its "
                                      f"layout-free state for tp rank {d.tp_rank} of {d.tp}, {shape} in this model")
            with torch.no_grad():
                if id(p) in masters:
                    self._set_unfused(p, masters[id(p)], values, step)
                elif hasattr(p, "ds_id"):
                    self._set_zero3(p, values)
                elif self._through_deepspeed:
                    self._set_zero12(p, values)
                else:
                    p.data.copy_(values["fp32"])
                    self._adam.state[p] = {"step": torch.tensor(float(step)), "exp_avg": values["exp_avg"].clone(),
                                           "exp_avg_sq": values["exp_avg_sq"].clone()}

    def _read_once(self, state: LayoutFreeState, name: str, key: str) -> torch.Tensor:
        """This rank's TP slice of ``key`` of ``name``, read once per data-parallel group: each
        replica reads an even share of its rows, and an all-gather over the group gives every
        replica the whole slice (every byte of the state is read by one rank; the group moves
        what a ZeRO all-gather of the weights moves, per key)."""
        d = self.dims
        shape = state.slice_shape(name, d.tp, d.tp_rank)
        if d.dp == 1 or not shape or shape[0] < d.dp:  # nothing to share (a scalar, a few rows)
            return state.read(name, key, d.tp, d.tp_rank)
        per = -(-shape[0] // d.dp)
        a, b = min(d.dp_rank * per, shape[0]), min((d.dp_rank + 1) * per, shape[0])
        mine = state.read(name, key, d.tp, d.tp_rank, rows=(a, b)).flatten().to(d.device)
        mine = F.pad(mine, (0, (per - (b - a)) * math.prod(shape[1:])))
        parts = [torch.empty_like(mine) for _ in range(d.dp)]
        dist.all_gather(parts, mine, group=d.dp_group)
        return torch.cat(parts)[:math.prod(shape)].view(shape)

    def _start_adam(self, step: int) -> None:
        """Gives every flat fp32 partition of a ZeRO / bf16 optimizer its Adam state (zeros until
        the values are set) at ``step``, and links DeepSpeed's per-parameter views to it."""
        opt, adam = self.ds.optimizer, self._adam
        flats = (getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_groups_flat_partition", None)
                 or getattr(opt, "fp32_partitioned_groups_flat", None))
        if flats is None:  # plain AdamW or FP16_UnfusedOptimizer: per-parameter state
            for st in adam.state.values():
                if "step" in st:
                    st["step"] = torch.tensor(float(step), dtype=st["step"].dtype)
            return
        for flat in flats:
            st = adam.state.setdefault(flat, {})
            st["step"] = torch.tensor(float(step))
            for k in KEYS[1:]:
                if k not in st:
                    st[k] = torch.zeros_like(flat)
        if hasattr(opt, "_hp_optimizer_states_linked"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def _set_unfused(self, p: torch.nn.Parameter, master: torch.Tensor, values: dict, step: int) -> None:
        master.data.copy_(values["fp32"])
        p.data.copy_(values["fp32"].to(p.dtype))
        st = self._adam.state.setdefault(master, {})
        st["step"] = torch.tensor(float(step))  # a master without state yet (no update so far) starts at the count
        for k in KEYS[1:]:
            st[k] = values[k].clone()

    def _set_zero12(self, p: torch.nn.Parameter, values: dict) -> None:
        """ZeRO-1/2 and the bf16 optimizer: this rank's fragments of the flat fp32 partition and
        its Adam state; the low-precision weight (whole on every rank) is the master cast."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        safe_set_full_fp32_param(p, values["fp32"])
        for k in KEYS[1:]:
            safe_set_full_optimizer_state(p, values[k], k)
        p.data.copy_(values["fp32"].to(p.dtype))

    def _set_zero3(self, p: torch.nn.Parameter, values: dict) -> None:
        """ZeRO-3: this rank's partition (ceil(numel / dp) elements, the last one padded) of the
        fp32 master, the Adam state and the low-precision weight; a persistent parameter (held
        whole between steps) gets its whole weight too."""
        opt = self.ds.optimizer
        rank = opt._get_param_partition_rank(p)
        for k in KEYS:
            part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False,
                                                        optim_state_key=None if k == "fp32" else k)
            n = part.numel()
            flat = values[k].flatten()
            flat = F.pad(flat, (0, max(0, n * (rank + 1) - flat.numel())))
            part.data.copy_(flat[rank * n:(rank + 1) * n])
            if k == "fp32":
                p.ds_tensor.data.copy_(flat[rank * n:rank * n + p.ds_tensor.numel()].to(p.ds_tensor.dtype))
        if p.numel() == p.ds_numel:
            p.data.copy_(values["fp32"].to(p.dtype).view_as(p))


def gather_pp_to_first(named: dict[str, torch.Tensor], dims: ParallelDims) -> Optional[dict[str, torch.Tensor]]:
    """Merges the stages' dictionaries onto stage 0 (None on the other stages); a pipeline
    replica keeps the first stage's copy."""
    if dims.pp == 1:
        return named
    parts = [None] * dims.pp if dims.is_first_stage else None
    dist.gather_object(named, parts, dst=dims.pp_ranks[0], group=dims.pp_group)
    if not dims.is_first_stage:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out
