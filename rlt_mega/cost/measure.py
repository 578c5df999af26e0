"""Measured counterparts of the cost model, with torch's own instruments (used by the tests,
and usable on a GPU node to check a plan before a long run).

Memory: ``torch.distributed._tools.mem_tracker.MemTracker``, a TorchDispatchMode that sees
every tensor an operator returns, follows its storage with a weak reference and sums the
live storages; it works on CPU (no allocator statistics needed) and counts exactly the bytes
of tensor storages (no allocator rounding, no kernel workspaces). FLOPs:
``torch.utils.flop_counter.FlopCounterMode`` (matmuls and attention kernels).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def peak_step_memory(step: Callable[[], object], *tracked, device: torch.device | str = "cpu"
                     ) -> dict[str, int]:
    """Peak bytes of tensor storages during one call of ``step``, after a first (untracked)
    call has created the optimizer state: the steady state of a long run. ``tracked`` are the
    objects that exist before (model, optimizer, input tensors), as MemTracker needs them."""
    step()
    tracker = _PeakTracker()
    tracker.track_external(*tracked)
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")[torch.device(device)]
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def _peak_tracker_class():
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class PeakTracker(MemTracker):
        """MemTracker's storage accounting without its per-module peak snapshots (which
        loop over every module at every operator: a decoder step calls 10 L modules)."""

        def _pre_fw_hook(self, module, inputs) -> None:
            """A module called again from no common root (the chunked head, loss.Logits, calls the
            model's final_norm and lm_head after the model's own call) is a new one here: MemTracker
            takes it for a second iteration and refuses; the totals do not depend on it."""
            parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
            if module in self.memory_tracking and not self._mod_tracker.is_bw and parents == {"Global"}:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if snap[_TOTAL_KEY] > self._peak_mem.get(dev, 0):
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return PeakTracker


def _PeakTracker():
    return _peak_tracker_class()()


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs that flop_counter attributes to ``fn()`` (forward and any backward inside), with the
    products flop_counter does not know added: the in-place ``addmm_`` / ``baddbmm_`` (the fused
    decoder's deferred weight and K/V gradients) and oneDNN's linear (its CPU products)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_extra_flops()) as counter:
        fn()
    return counter.get_total_flops()


def _extra_flops() -> dict:
    def addmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # (m, k) @ (k, n)
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    def baddbmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # (b, m, k) @ (b, k, n)
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]

    def linear(x_shape, *args, out_shape=None, **kwargs) -> int:  # x (..., in) -> out (..., out)
        n = 1
        for s in out_shape:
            n *= s
        return 2 * n * x_shape[-1]

    aten = torch.ops.aten
    extra = {aten.addmm_: addmm, aten.baddbmm_: baddbmm}
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        extra[torch.ops.mkldnn._linear_pointwise] = linear
    return extra


def zero_probe(rank: int, world_size: int, port: int, model_cfg: dict, cases: list[dict],
               results) -> None:
    """One rank of a DeepSpeed data-parallel run (gloo, CPU): for each case (``zero_stage``,
    ``checkpointing`` kwargs, ``batch``, ``seq_len``, ``buckets``) builds the engine around a
    torch AdamW, runs two steps and records, for the second, the peak bytes of tensor
    storages, the numel of the Adam moments DeepSpeed's inner optimizer holds on this rank
    and of its fp32 master partition. Meant for ``torch.multiprocessing.spawn``."""
    import logging
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT-built op on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    from rlt_mega.config import ModelConfig

    cfg = ModelConfig(**model_cfg)
    results[rank] = [_zero_case(cfg, case, rank) for case in cases]


def _zero_case(cfg, case: dict, rank: int) -> dict:
    """One case of :func:`zero_probe`: peak storage bytes of the second step, Adam moments and
    fp32 master numel on this rank."""
    import deepspeed

    from rlt_mega.config import CheckpointingConfig
    from rlt_mega.model.rlt import build_model

    model = build_model(cfg, seed=0)
    model.set_checkpointing(CheckpointingConfig(**case.get("checkpointing", {})))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ds_config = {
        "train_micro_batch_size_per_gpu": case["batch"], "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
        "zero_optimization": {"stage": case["zero_stage"], **case.get("buckets", {})},
    }
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (case["batch"], case["seq_len"]), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (case["batch"], case["seq_len"]), generator=gen)
    tracker = _PeakTracker()
    tracker.track_external(model, tokens, targets)
    with tracker:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        for i in range(2):
            if i == 1:  # measure the steady state only
                tracker.reset_mod_stats()
                tracker._peak_mem = {}
            loss = F.cross_entropy(engine(tokens).flatten(0, 1), targets.flatten())
            engine.backward(loss)
            engine.step()
            del loss
    zero_opt = engine.optimizer
    moments = sum(t.numel() for s in zero_opt.optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    masters = getattr(zero_opt, "single_partition_of_fp32_groups", None) or \
        getattr(zero_opt, "fp32_partitioned_groups_flat", [])
    return {"peak": int(tracker.get_tracker_snapshot("peak")[tokens.device]["Total"]),
            "moments_numel": int(moments), "master_numel": int(sum(t.numel() for t in masters))}
