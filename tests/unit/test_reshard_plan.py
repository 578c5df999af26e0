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


def test_a_rank_on_another_layout_takes_every_replicas_job_state_from_its_last_stage():
    """train/loop.py source_ranks and position_rank: Megatron's order, rank = tp_rank + tp *
    (dp_rank + dp * pp_rank)."""
    from types import SimpleNamespace

    from rlt_mega.train.loop import position_rank, source_ranks

    saved = {"tp": 2, "pp": 2, "dp": 2, "pp_split": [1, 1]}
    assert source_ranks(saved) == [4, 6]  # pp 1, tp 0, dp d
    assert source_ranks({"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}) == [0]
    at = SimpleNamespace(tp_rank=1, pp_rank=1, dp_rank=3)
    assert position_rank(saved, {"tp": 2, "pp": 2, "dp": 4, "zero_stage": 1}, at) == 7  # replica 1's (the last)
    assert position_rank(saved, {"tp": 2, "pp": 2, "dp": 4, "pp_split": [2, 0]}, at) is None  # another split
    assert position_rank(saved, {"tp": 1, "pp": 2, "dp": 8}, at) is None


def _queued(dp: int, prompts: int, group: int, batch: int, step: int = 3) -> list:
    """Data step ``step`` as replica d of ``dp`` queues it: every dp-th of ``prompts`` prompts from
    d, ``group`` rows each, in rollout batches of ``batch`` rows (one minibatch); each row's tokens
    hold its global row, its score the same."""
    from rlt_mega.rollout.sampler import Rollout
    from rlt_mega.train.async_grpo import Generated
    from rlt_mega.train.grpo_rounds import Round

    out = []
    for d in range(dp):
        ids = [p * group + g for p in range(d, prompts, dp) for g in range(group)]
        rollouts = [Rollout(torch.tensor(ids[a:a + batch]).view(-1, 1), torch.zeros(batch, 1), torch.ones(batch, 1),
                            [1] * batch, ["length"] * batch, None) for a in range(0, len(ids), batch)]
        rnd = Round([{"row": i} for i in ids], [rollouts], [float(i) for i in ids], [0.0] * len(ids), failures=d + 1,
                    nonfinite=0, group_keep=torch.tensor([p % 3 != 0 for p in range(d, prompts, dp)]))
        out.append(Generated(step, 2, [rnd], {"sampling/rounds": 1.0}, order={"epoch": 0, "cursor": 8}))
    return out


def _rows(item) -> list[list[int]]:
    return [ro.tokens.view(-1).tolist() for ro in item.rounds[0].rollouts[0]]


def test_a_queued_data_step_is_re_split_into_the_shares_of_another_data_parallel_size():
    """train/async_grpo.py resplit: the saved replicas' batches of a data step, dealt as the new
    layout samples it (share s holds every dp-th prompt from s), whole batches, rows with them."""
    from rlt_mega.config import ConfigError
    from rlt_mega.train.async_grpo import Generated, ShareCut, StalenessPipeline, resplit

    G = 2
    queued = _queued(2, 4, G, G)  # 2 replicas x 2 prompts x 2 rows, one group per batch
    merged = resplit(queued, ShareCut(1, 0, 8, 2, G))
    assert _rows(merged) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # dp=1's own order: prompts 0, 1, 2, 3
    rnd = merged.rounds[0]
    assert rnd.scores == [float(i) for i in range(8)] and [r["row"] for r in rnd.rows] == list(range(8))
    assert rnd.group_keep.tolist() == [False, True, True, False] and rnd.failures == 3
    assert merged.sampling["sampling/groups_kept"] == 2 and merged.sampling["sampling/prompts_drawn"] == 4
    assert (merged.step, merged.version, merged.order) == (3, 2, {"epoch": 0, "cursor": 8})
    split = [resplit(queued, ShareCut(4, s, 2, 2, G)) for s in range(4)]
    assert [_rows(x) for x in split] == [[[2 * s, 2 * s + 1]] for s in range(4)]  # share s: prompt s
    assert [x.rounds[0].failures for x in split] == [1, 2, 0, 0]  # each saved replica's count once
    same = [resplit(queued, ShareCut(2, s, 4, 2, G)) for s in range(2)]
    assert [_rows(x) for x in same] == [_rows(x) for x in queued]  # the same dp: the same shares
    # batches of two prompts: merged whole (dp=1: the replicas' batches in turn), split in blocks
    assert _rows(resplit(_queued(2, 4, G, 4), ShareCut(1, 0, 8, 4, G))) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    wide = _queued(2, 8, G, 4)
    assert [_rows(resplit(wide, ShareCut(4, s, 4, 4, G))) for s in range(4)] == \
        [[[0, 1, 4, 5]], [[8, 9, 12, 13]], [[2, 3, 6, 7]], [[10, 11, 14, 15]]]
    # a group split over batches moves with its batches
    assert [_rows(resplit(_queued(2, 4, G, 1), ShareCut(4, s, 2, 1, G))) for s in range(4)] == \
        [[[2 * s], [2 * s + 1]] for s in range(4)]
    with pytest.raises(ConfigError, match=r"2 replicas x 4 rows, and this run's global batch is dp=1 x 4 rows .* "
                                          r"resume with grpo.prompts_per_step=4"):
        resplit(queued, ShareCut(1, 0, 4, 2, G))
    with pytest.raises(ConfigError, match=r"rollout batches of \[2\] rows, and this run cuts its minibatches of 8 "
                                          r"rows into batches of 8"):
        resplit(queued, ShareCut(1, 0, 8, 8, G))
    # the pipeline: every saved replica's queue, checked, re-split per data step
    saved = [StalenessPipeline(1, (2, 1, 1, d)) for d in range(2)]
    for pipe, item in zip(saved, queued):
        pipe.push(item)
    moved = StalenessPipeline(1, (1, 1, 1, 0))
    moved.load_moved([p.state_dict() for p in saved], 3, ShareCut(1, 0, 8, 2, G))
    assert [_rows(x) for x in moved.queue] == [_rows(merged)]
    with pytest.raises(ConfigError, match="holds no sampled steps for grpo.max_staleness=1"):
        moved.load_moved([saved[0].state_dict(), None], 3, ShareCut(1, 0, 8, 2, G))
    saved[1].queue[0] = Generated(4, 3, queued[1].rounds, {})
    with pytest.raises(ConfigError, match=r"queues data steps \[\[3\], \[4\]\] on its replicas: it is damaged"):
        moved.load_moved([p.state_dict() for p in saved], 3, ShareCut(1, 0, 8, 2, G))


def _rank_flats(cfg, model, tp: int, pp: int) -> dict:
    """(pp_rank, tp_rank) -> the flat copy of that rank's module, cut as parallel/tp.py cuts a
    parameter (torch.chunk along its TP dimension) on the stage's pruned model."""
    out = {}
    full = dict(model.named_parameters())
    for p, stage in enumerate(_stages(cfg, pp)):
        for t in range(tp):
            parts = []
            for name, _ in stage.named_parameters():
                x = full[name if name in full else "embed.weight"]
                dim = shard_dim(name)
                parts.append((x if dim is None else x.chunk(tp, dim)[t]).reshape(-1))
            out[(p, t)] = torch.cat(parts)
    return out


def _stages(cfg, pp: int) -> list:
    from rlt_mega.parallel.dims import split_layers
    from rlt_mega.parallel.stage import prune_to_stage

    out = []
    for p, layers in enumerate(split_layers(cfg.n_layers, pp)):
        stage = build_model(cfg, "meta")
        if pp > 1:
            prune_to_stage(stage, layers, p == 0, p == pp - 1)
        out.append(stage)
    return out


def _tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(torch.randn_like(q))
    return cfg, model


def test_a_flat_copy_of_parameters_is_recut_for_another_tp_and_pp_by_the_tp_plan():
    """parallel/reshard.py recut_flat: the flat copies of one replica's ranks made whole per
    parameter and cut for any other place; a flat copy of another model refused."""
    from rlt_mega.parallel.reshard import recut_flat

    cfg, model = _tiny()
    whole = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    named = [(n, tuple(q.shape)) for n, q in model.named_parameters()]
    one = _rank_flats(cfg, model, 1, 1)
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        flats = _rank_flats(cfg, model, tp, pp)
        assert torch.equal(recut_flat(cfg, layout(tp, pp), flats, named, 1, 0), whole)
        for p, stage in enumerate(_stages(cfg, pp)):  # one process's copy -> each place of (tp, pp)
            for t in range(tp):
                mine = []
                for n, q in stage.named_parameters():
                    shape, dim = list(q.shape), shard_dim(n)
                    if dim is not None:
                        a, b = bounds(shape[dim], tp)[t]
                        shape[dim] = b - a
                    mine.append((n, tuple(shape)))
                assert torch.equal(recut_flat(cfg, layout(), one, mine, tp, t), flats[(p, t)])
    with pytest.raises(CheckpointError, match=r"holds 3 values, \d+ by the model's config: the checkpoint and its "
                                              r"config.yaml do not belong together"):
        recut_flat(cfg, layout(), {(0, 0): torch.zeros(3)}, named, 1, 0)


def test_kept_policy_versions_move_to_any_layout():
    """train/grpo.py load_moved_rank_state: the queue re-split, and the policy versions kept for
    partial rollouts taken from the saved rank at this rank's place (same tp and pp), or re-cut
    from every place of one saved replica (another tp); a replica whose places keep different
    versions refused, and the on-policy check of samples queued on another tp."""
    from types import SimpleNamespace

    from rlt_mega.config import ConfigError
    from rlt_mega.train.async_grpo import PolicyHistory, StalenessPipeline, VersionPlan
    from rlt_mega.train.grpo import GRPOJob
    from rlt_mega.train.loop import SavedReplica

    cfg, model = _tiny()
    whole = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    flats = _rank_flats(cfg, model, 2, 1)
    saved = []
    for d, item in enumerate(_queued(2, 4, 2, 2)):
        pipe = StalenessPipeline(1, (2, 1, 1, d), 1)
        pipe.push(item)
        saved.append({"pipeline": pipe.state_dict(), "previous": whole, "versions": {2: whole}})

    def job():
        grpo = SimpleNamespace(group_size=2, verify_onpolicy=False, partial_rollouts=1)
        cut = SimpleNamespace(minibatch_rows=8, batch_rows=2)
        j = SimpleNamespace(cfg=SimpleNamespace(grpo=grpo, model=cfg), phases=SimpleNamespace(cut=cut),
                            dims=SimpleNamespace(dp=1, dp_rank=0, tp=1, tp_rank=0, pp=1),
                            pipeline=StalenessPipeline(1, (1, 1, 1, 0), 1), policy=SimpleNamespace(module=lambda: model),
                            history=PolicyHistory(VersionPlan(1, 1, 2), False))
        j._load_history = lambda state, step: GRPOJob._load_history(j, state, step)
        j._recut_history = lambda state, step: GRPOJob._recut_history(j, state, step)
        return j

    moved = job()
    GRPOJob.load_moved_rank_state(moved, saved, saved[0], 3)
    assert sorted(moved.history.kept) == [2] and moved.steps_done == 3
    assert [_rows(x) for x in moved.pipeline.queue] == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    places = {(0, t): {"previous": flats[(0, t)], "versions": {2: flats[(0, t)]}} for t in range(2)}
    recut = job()  # saved on tp=2 (replica 0's two places), resumed in one process
    GRPOJob.load_moved_rank_state(recut, saved, SavedReplica(layout(2), lambda p, t: places[(p, t)]), 3)
    assert sorted(recut.history.kept) == [2] and torch.equal(recut.history.kept[2], whole)
    checked = job()
    checked.cfg.grpo.verify_onpolicy = True
    with pytest.raises(ConfigError, match=r"queues samples drawn on tp=2, which grpo.verify_onpolicy replays bit for "
                                          r"bit against their mu: on tp=1 .*: resume with grpo.verify_onpolicy=false "
                                          r"\(the kept policy versions move\) or with parallel.tp=2$"):
        GRPOJob.load_moved_rank_state(checked, saved, SavedReplica(layout(2), lambda p, t: places[(p, t)]), 3)
    places[(0, 1)] = {"previous": None, "versions": {}}
    with pytest.raises(CheckpointError, match=r"keeps policy versions \[\[\], \[2\]\] on the ranks of one replica"):
        GRPOJob.load_moved_rank_state(job(), saved, SavedReplica(layout(2), lambda p, t: places[(p, t)]), 3)
