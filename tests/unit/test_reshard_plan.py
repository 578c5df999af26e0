"""The layout-free state (rlt_mega/parallel/reshard.py) without DeepSpeed: which dimension each
parameter is cut along (the TP plan, adapters included), the pieces torch.chunk makes, the
state written by one layout and read by any other slice for slice, a missing piece named, and
the patterns that tell DeepSpeed's universal-checkpoint converter how our slices join."""

import re

import pytest
import torch

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.config import ModelConfig
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.reshard import (KEYS, LayoutFreeState, StateWriter, bounds, changes, owner, resumable_on,
                                       same_layout, shard_dim, universal_checkpoint_info)


def layout(tp=1, pp=1, dp=1, zero=0, split=None):
    out = {"tp": tp, "pp": pp, "dp": dp, "zero_stage": zero}
    if split is not None:
        out["pp_split"] = split
    return out


def test_the_cut_of_each_parameter_follows_the_tp_plan_and_the_adapters_follow_their_layer():
    assert shard_dim("blocks.0.attn.q.weight") == 0 and shard_dim("blocks.0.attn.o.weight") == 1
    assert shard_dim("embed.weight") == 0 and shard_dim("final_norm.weight") is None
    assert shard_dim("blocks.0.attn.o.bias") is None and shard_dim("blocks.0.attn.q.bias") == 0
    lora = "blocks.1.{}.parametrizations.weight.0.lora_{}"
    assert shard_dim(lora.format("attn.q", "B")) == 0 and shard_dim(lora.format("attn.q", "A")) is None
    assert shard_dim(lora.format("mlp.down", "A")) == 1 and shard_dim(lora.format("mlp.down", "B")) is None
    assert shard_dim("recur_proj.parametrizations.weight.0.lora_A") is None


def test_pieces_are_torch_chunks_and_parameters_are_dealt_over_the_data_parallel_ranks():
    assert bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert bounds(10, 4) == [(i * 3, min(10, i * 3 + 3)) for i in range(4)]
    assert [p.shape[0] for p in torch.arange(10).chunk(4)] == [b - a for a, b in bounds(10, 4)]
    names = ["embed.weight", "final_norm.weight", "blocks.0.attn.q.weight"]
    for tp_rank in range(2):
        writers = [[owner(i, n, tp_rank, d, 2) for d in range(2)] for i, n in enumerate(names)]
        assert writers[0] == [True, False] and writers[2] == [True, False]
        assert writers[1] == ([False, True] if tp_rank == 0 else [False, False])  # replicated: TP rank 0 only


def test_layouts_compare_and_changes_are_named():
    assert same_layout(layout(pp=2, dp=2, zero=1), layout(pp=2, dp=2, zero=1, split=[2, 2]))  # before pp_split
    assert not same_layout(layout(pp=2, zero=1, split=[3, 1]), layout(pp=2, zero=1, split=[2, 2]))
    assert not same_layout(layout(dp=2, zero=1), layout(dp=2, zero=2))
    assert changes(layout(tp=2, pp=2, zero=1, split=[1, 1]), layout(tp=4, zero=3)) == "tp 2->4, pp 2->1, zero_stage 1->3"
    assert "any layout" in resumable_on(layout(tp=2, dp=2, zero=3))


def _write(root, full: dict, tp: int, dp: int = 1):
    """The state of ``full`` as a layout with ``tp`` tensor-parallel ranks writes it."""
    for tp_rank in range(tp):
        writers = [StateWriter(root, tp_rank, d, tp, tp_rank, {"adam_step": 7, "steps_taken": 5}, bucket_bytes=512)
                   for d in range(dp)]
        for i, (name, values) in enumerate(full.items()):
            dim = shard_dim(name)
            for d in range(dp):
                if owner(i, name, tp_rank, d, dp):
                    writers[d].add(name, {k: v if dim is None else v.chunk(tp, dim)[tp_rank] for k, v in values.items()})
        for w in writers:
            w.close()


def _full():
    g = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (12, 4), "blocks.0.attn.o.weight": (4, 8), "final_norm.weight": (4,),
              "blocks.0.attn.q.weight": (8, 4)}
    return {n: {k: torch.randn(s, generator=g) for k in KEYS} for n, s in shapes.items()}


@pytest.mark.parametrize("tp_from,tp_to,dp", [(2, 4, 1), (4, 1, 2), (1, 2, 3), (2, 3, 1)])
def test_any_layout_reads_the_slices_another_wrote(tmp_path, tp_from, tp_to, dp):
    full = _full()
    _write(tmp_path, full, tp_from, dp)
    state = LayoutFreeState.open(tmp_path)
    assert (state.tp, state.adam_step, state.steps_taken) == (tp_from, 7, 5)
    assert state.names() == sorted(full)
    assert len(list((tmp_path / "state").iterdir())) > tp_from  # buckets of 512 bytes: several files a rank
    for name, values in full.items():
        assert state.full_shape(name) == tuple(values["fp32"].shape)
        dim = shard_dim(name)
        for t in range(tp_to):
            for key, v in values.items():
                want = v if dim is None else v.chunk(tp_to, dim)[t]
                assert torch.equal(state.read(name, key, tp_to, t), want), (name, key, t)
                assert state.slice_shape(name, tp_to, t) == tuple(want.shape)
                for a, b in ((0, 1), (1, 3), (2, 2), (len(want) - 1, len(want))):  # a data-parallel rank's rows
                    before = state.bytes_read
                    assert torch.equal(state.read(name, key, tp_to, t, rows=(a, b)), want[a:b]), (name, key, t, a, b)
                    assert state.bytes_read - before == want[a:b].numel() * 4  # those rows, no more
    assert state.lookup("lm_head.weight", tied=True) == "embed.weight"
    with pytest.raises(CheckpointError, match="has no 'lm_head.weight'"):
        state.lookup("lm_head.weight", tied=False)


def test_a_missing_piece_and_a_checkpoint_without_the_state_are_named(tmp_path):
    _write(tmp_path / "a", _full(), 2)
    victim = next(f for f in sorted((tmp_path / "a" / "state").iterdir()) if f.name.startswith("mp001"))
    victim.unlink()
    with pytest.raises(CheckpointError, match=r"holds tensor-parallel slices \[0\] of '.*', expected \[0, 1\]"):
        LayoutFreeState.open(tmp_path / "a")
    (tmp_path / "b").mkdir()
    with pytest.raises(CheckpointError, match=r"has no layout-free state \(state/\).*rlt-mega export"):
        LayoutFreeState.open(tmp_path / "b")


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": True, "share_weights": False}])
def test_universal_patterns_name_each_parameter_once_with_its_tensor_parallel_split(overrides):
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, **overrides)
    info = universal_checkpoint_info(cfg)
    names = [n for n, _ in build_model(cfg, "meta").named_parameters()]
    replicated, rows = info["tp_replicated_parameter_patterns"], info["parameter_with_row_parallelism_patterns"]
    for pattern in replicated + rows:  # the converter's strict mode: every pattern matches a parameter
        assert sum(bool(re.match(pattern, n)) for n in names) == 1, pattern
    row_names = {n for n in names if any(re.match(p, n) for p in rows)}
    assert row_names == {n for n in names if n.endswith(("attn.o.weight", "mlp.down.weight"))}
    replicated_names = {n for n in names if any(re.match(p, n) for p in replicated)}
    assert {"null_memory", "z_init", "recur_proj.weight", "final_norm.weight"} <= replicated_names
    split = ("attn.q.weight", "attn.q.bias", "mlp.up.weight", "embed.weight")
    assert not any(n.endswith(split) for n in replicated_names)


def test_a_rank_on_another_layout_takes_its_replicas_job_state_from_the_last_stage():
    """train/loop.py source_rank: Megatron's order, rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    from types import SimpleNamespace

    from rlt_mega.train.loop import source_rank

    saved = {"tp": 2, "pp": 2, "dp": 2}
    assert [source_rank(saved, SimpleNamespace(dp_rank=d)) for d in range(2)] == [4, 6]  # pp 1, tp 0, dp d
    assert source_rank(saved, SimpleNamespace(dp_rank=3)) == 6  # fewer replicas saved: the last one's
    assert source_rank({"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}, SimpleNamespace(dp_rank=0)) == 0


def test_a_grpo_queue_moves_to_another_tp_pp_or_zero_stage_but_not_to_another_dp():
    from rlt_mega.config import ConfigError
    from rlt_mega.train.async_grpo import Generated, StalenessPipeline

    saved = StalenessPipeline(1, (2, 2, 2, 6))  # dp 2, tp 2, pp 2, rank 6
    saved.push(Generated(step=3, version=2, rounds=[], sampling={}))
    moved = StalenessPipeline(1, (2, 4, 1, 1))  # dp 2 on tp 4: the queue moves
    moved.load_state_dict(saved.state_dict(), 3)
    assert [g.step for g in moved.queue] == [3]
    with pytest.raises(ConfigError, match=r"parallel.dp=2 replicas .* this run has parallel.dp=4: resume with "
                                          r"parallel.dp=2"):
        StalenessPipeline(1, (4, 1, 1, 0)).load_state_dict(saved.state_dict(), 3)
