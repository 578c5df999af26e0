"""`rlt-mega plan --config X` accepts exactly the layouts `rlt-mega pretrain --config X` runs, message
for message on rejection, on a grid of layouts with uneven stages, explicit splits, TP
divisibility, world sizes and micro-batch plans. Both call the same pure rules
(parallel/dims.py: ``resolve_layout``, ``split_layers``, ``check_tp``, ``micro_batch_plan``),
before any process group exists; the grid compares the planner's answer with the rule the
trainer's launch runs, and real `rlt-mega pretrain` runs on one process confirm that the CLI
gives the same message (tests/e2e/test_pretrain_distributed_cli.py launches an uneven-stage
layout on two ranks)."""

from __future__ import annotations

import io
import itertools
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch.distributed as dist

from rlt_mega import cli
from rlt_mega.config import ConfigError, load_config
from rlt_mega.parallel.dims import micro_batch_plan, resolve_layout, split_layers
from rlt_mega.parallel.engine import EngineConfig
from rlt_mega.parallel.launch import launch
from rlt_mega.cost.cli import main as plan_main

CONFIG = "configs/tiny_cpu.yaml"
MODEL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64", "data.seq_len=8",
         "model.vocab_size=260"]
# (tp, pp, pp_split); the model has 3, 4 or 5 layers and 4 heads (2 key/value heads)
SPLITS = [(1, 1, None), (2, 1, None), (3, 1, None), (1, 2, None), (1, 4, None), (2, 2, None), (1, 2, [2, 1]),
          (1, 2, [1, 4]), (1, 3, [1, 1, 3]), (1, 1, [3]), (1, 2, [3, 0])]
STEPS = [(4, 1, 1), (4, 4, 2), (4, 1, 4), (2, 1, 4), (4, 4, 3)]  # (rows, grad_accum, M)
WORLDS = [1, 2, 3, 4]


def case(layers, tp, pp, split, world, rows, accum, M, zero=0):
    overrides = MODEL + [f"model.n_layers={layers}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                         f"train.micro_batch_size={rows}", f"train.grad_accum={accum}", f"parallel.micro_batches={M}",
                         f"parallel.zero_stage={zero}"]
    if split is not None:
        overrides.append(f"parallel.pp_split={json.dumps(split)}")
    return overrides, world


def grid():
    for layers, (tp, pp, split), world, (rows, accum, M) in itertools.product((3, 5), SPLITS, WORLDS, STEPS):
        yield case(layers, tp, pp, split, world, rows, accum, M)
    for layers, (tp, pp, split), world in itertools.product((3, 5), SPLITS, (2, 4)):  # ZeRO-3: not with pp > 1
        yield case(layers, tp, pp, split, world, 4, 1, 1, zero=3)


CASES = list(grid())


def plan_verdict(overrides: list[str], world: int) -> str:
    """"ok", or the message `rlt-mega plan` prints after "error: "."""
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        code = plan_main(["--config", CONFIG, "--world-size", str(world), "--json", *overrides])
    if code == 0:
        return "ok"
    assert code == 2 and err.getvalue().startswith("rlt-mega plan: error: ")
    return err.getvalue()[len("rlt-mega plan: error: "):].rstrip("\n")


def trainer_verdict(overrides: list[str], world: int) -> str:
    """"ok", or the ConfigError of what the trainer's launch checks on a world of ``world`` ranks
    (parallel/launch.py: resolve_layout with the step's shape, before any process group)."""
    try:
        cfg = load_config(CONFIG, overrides)
        resolve_layout(cfg.parallel, cfg.model, world, EngineConfig.from_train(cfg.train))
    except ConfigError as exc:
        return str(exc)
    return "ok"


@pytest.fixture(scope="module")
def verdicts():
    return [trainer_verdict(o, w) for o, w in CASES]


def test_the_grid_covers_acceptance_rejection_and_uneven_stages(verdicts):
    accepted = [(o, w) for (o, w), v in zip(CASES, verdicts) if v == "ok"]
    assert 40 < len(accepted) < len(CASES) - 200
    uneven = [o for o, w in accepted if "model.n_layers=5" in o and "parallel.pp=2" in o and
              not any(x.startswith("parallel.pp_split") for x in o)]
    assert uneven  # 5 layers on 2 stages, no explicit split: the trainer runs [3, 2]
    rejections = " | ".join(v for v in verdicts if v != "ok")
    for rule in ("does not divide the world size", "model.n_heads=4 is not divisible by parallel.tp=3",
                 "some stages would have no layers", "sums to", "expected a list of positive layer counts",
                 "is not a multiple of parallel.micro_batches", "cannot be formed",
                 "zero_stage=3 with parallel.pp > 1 is not supported"):
        assert rule in rejections, rule


def test_plan_accepts_exactly_what_the_trainer_runs_message_for_message(verdicts):
    for (overrides, world), verdict in zip(CASES, verdicts):
        assert plan_verdict(overrides, world) == verdict, (overrides, world)


def test_plan_costs_uneven_stages_with_the_trainers_split():
    overrides = MODEL + ["model.n_layers=5", "parallel.pp=2", "parallel.micro_batches=2", "train.micro_batch_size=4"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert plan_main(["--config", CONFIG, "--world-size", "2", "--json", *overrides]) == 0
    report = json.loads(out.getvalue())
    assert [r["layers"] for r in report["per_rank"]] == [list(r) for r in split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert report["per_rank"][0]["params"]["blocks"] > report["per_rank"][1]["params"]["blocks"]


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=3"],  # 4 heads
    ["model.n_layers=2", "parallel.pp=3"],
    ["parallel.pp_split=[1, 1]"],  # pp=1
    ["train.grad_accum=3", "parallel.micro_batches=2"],
    ["parallel.dp=2"],
])
def test_rlt_mega_pretrain_refuses_with_the_plans_message(overrides, tmp_path, capsys):
    """The CLI on one process (a world of one), before any data is read or any process group exists."""
    args = [*MODEL, *overrides, f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]
    assert cli.main(["pretrain", "--config", CONFIG, *args]) == 2
    message = capsys.readouterr().err
    assert message.startswith("rlt-mega pretrain: error: ")
    assert message[len("rlt-mega pretrain: error: "):].rstrip("\n") == plan_verdict(args, 1) != "ok"
    assert not dist.is_initialized()


def test_rlt_mega_pretrain_runs_what_the_plan_accepts_on_one_process(tmp_path):
    """micro_batches=2 with grad_accum=2 on one process: the plan accepts it and so does the
    launch, which builds the single-process layout without a process group."""
    args = [*MODEL, "parallel.micro_batches=2", "train.grad_accum=2", "train.micro_batch_size=2", "train.steps=1",
            "data.generated.num_train=40", "data.generated.num_eval=4", "train.eval_every=0", "logging.progress=false",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]
    assert plan_verdict(args, 1) == "ok"
    with launch(load_config(CONFIG, args)) as dims:
        assert not dims.distributed and not dist.is_initialized() and micro_batch_plan(2, 2, 2) == (1, 1)
    assert cli.main(["pretrain", "--config", CONFIG, *args]) == 0
    assert (tmp_path / "ckpt" / "step_00000001" / "manifest.json").is_file() and not dist.is_initialized()
