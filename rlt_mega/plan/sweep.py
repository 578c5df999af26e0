"""Sweeps: a grid of short training runs from one YAML file, collected into one CSV and one
plot of loss against compute (one line per configuration).

    base: configs/tiny_cpu.yaml          # the config every run starts from
    out: runs/sweep                      # one directory per run below it, plus the CSV and PNG
    overrides: [train.steps=60]          # applied to every run
    grid:                                # the cartesian product of the axes, in this order
      model.memory_block: [1, 4, 16]
      model.n_layers: [2, 4]
      size:                              # an axis of mappings sets several keys at once
        - {name: d64, model.d_model: 64, model.n_heads: 4}
        - {name: d128, model.d_model: 128, model.n_heads: 4}
    label: "C={model.memory_block} L={model.n_layers}"    # optional legend format
    title: "C x L on CPU"                                 # optional plot title
    smooth: 5                                             # trailing mean over logged losses
    launcher: ["{python}", "-m", "rlt_mega"]              # optional: e.g. torchrun for layouts
    env: {OMP_NUM_THREADS: "1"}                           # optional

Each run is ``<launcher> pretrain --config <base> <overrides> <axis overrides>`` in a
subprocess, with logging.dir and checkpoint.dir inside its own directory; a run whose
``result.json`` exists is not run again (a sweep can be resumed). Compute is the cost
model's training FLOPs per token (forward + backward, no recomputation: the MFU
convention) times the tokens trained. Peak memory is the peak resident set size of the run's
process (on CPU it includes the Python and torch runtime, a few hundred MB), and the
trainer's own ``train/peak_memory_bytes`` metric when it logs one, beside the cost model's
prediction for the step itself.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from rlt_mega.config import Config, ConfigError, load_config, read_yaml
from rlt_mega.log import get_logger
from rlt_mega.plan.flops import flop_rows, summarize
from rlt_mega.plan.layout import Layout
from rlt_mega.plan.memory import estimate_memory

log = get_logger(__name__)

PEAK_METRIC = "train/peak_memory_bytes"
SWEEP_KEYS = {"base", "out", "overrides", "grid", "label", "launcher", "env", "title", "smooth"}


@dataclass
class Run:
    name: str  # directory name
    label: str  # legend
    overrides: list[str]  # the run's own (axis) overrides
    values: dict[str, Any]  # axis -> value (a mapping's name for mapping axes)
    config: Optional[Config] = None


@dataclass
class Sweep:
    base: str
    out: Path
    overrides: list[str]
    runs: list[Run]
    launcher: list[str] = field(default_factory=lambda: ["{python}", "-m", "rlt_mega"])
    env: dict[str, str] = field(default_factory=dict)
    title: Optional[str] = None
    smooth: int = 1


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def _axis_points(axis: str, values: Any) -> list[tuple[Any, list[str]]]:
    """[(value for names and labels, overrides)] of one grid axis."""
    if not isinstance(values, list) or not values:
        raise ConfigError(f"sweep grid axis '{axis}' must be a non-empty list of values")
    points = []
    for i, v in enumerate(values):
        if isinstance(v, dict):
            keys = {k: x for k, x in v.items() if k != "name"}
            if not keys:
                raise ConfigError(f"sweep grid axis '{axis}', entry {i}: a mapping needs at least one key")
            points.append((v.get("name", f"{axis}{i}"), [f"{k}={_scalar(x)}" for k, x in keys.items()]))
        else:
            points.append((v, [f"{axis}={_scalar(v)}"]))
    return points


def _short(axis: str) -> str:
    return axis.rsplit(".", 1)[-1]


def _label(fmt: Optional[str], values: dict[str, Any]) -> str:
    if not fmt:
        return " ".join(f"{_short(k)}={v}" for k, v in values.items())

    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ConfigError(f"sweep label '{fmt}' names '{m.group(1)}', which is not a grid axis "
                              f"({', '.join(values)})")
        return str(values[m.group(1)])
    return re.sub(r"\{([^}]+)\}", sub, fmt)


def expand(spec: dict, base_dir: Path = Path(".")) -> Sweep:
    """The runs of a sweep spec (a parsed YAML mapping), each config loaded and validated."""
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise ConfigError(f"unknown sweep key(s) {sorted(unknown)}; valid keys: {sorted(SWEEP_KEYS)}")
    if "base" not in spec or "grid" not in spec:
        raise ConfigError("a sweep needs 'base' (a config file) and 'grid' (axes of values)")
    base = str(spec["base"])
    overrides = [str(o) for o in spec.get("overrides", [])]
    grid = spec["grid"]
    if not isinstance(grid, dict) or not grid:
        raise ConfigError("sweep 'grid' must be a mapping of axis -> list of values")
    axes = {axis: _axis_points(axis, values) for axis, values in grid.items()}
    runs = []
    for combo in itertools.product(*axes.values()):
        values = {axis: point[0] for axis, point in zip(axes, combo)}
        run_overrides = [o for point in combo for o in point[1]]
        name = "__".join(f"{_short(a)}={re.sub(r'[^A-Za-z0-9_.-]', '_', str(v))}" for a, v in values.items())
        try:
            cfg = load_config(base, overrides + run_overrides)
        except ConfigError as exc:
            raise ConfigError(f"sweep run {name}: {exc}") from None
        runs.append(Run(name, _label(spec.get("label"), values), run_overrides, values, cfg))
    if len({r.name for r in runs}) != len(runs):
        raise ConfigError("two sweep runs have the same name: give mapping axes distinct 'name's")
    out = Path(spec.get("out", "runs/sweep"))
    return Sweep(base=base, out=out if out.is_absolute() else base_dir / out, overrides=overrides, runs=runs,
                 launcher=[str(x) for x in spec.get("launcher", ["{python}", "-m", "rlt_mega"])],
                 env={str(k): str(v) for k, v in spec.get("env", {}).items()},
                 title=spec.get("title"), smooth=_positive_int(spec.get("smooth", 1), "smooth"))


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"sweep '{name}' must be a positive integer, got {value!r}")
    return value


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values up to each point."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window))
            for i in range(len(values))]


def load_sweep(path: str | Path) -> Sweep:
    return expand(read_yaml(path))


# ------------------------------------------------------------------ running
def run_dir(sweep: Sweep, run: Run) -> Path:
    return sweep.out / run.name


def command(sweep: Sweep, run: Run) -> list[str]:
    d = run_dir(sweep, run)
    launcher = [x.replace("{python}", sys.executable) for x in sweep.launcher]
    return launcher + ["pretrain", "--config", sweep.base, *sweep.overrides, *run.overrides,
                       f"logging.dir={d / 'tb'}", f"checkpoint.dir={d / 'checkpoints'}", "logging.progress=false"]


def execute(sweep: Sweep, run: Run, force: bool = False) -> dict:
    """Runs one configuration (unless its result.json exists) and returns its result."""
    d = run_dir(sweep, run)
    result_path = d / "result.json"
    if result_path.exists() and not force:
        return json.loads(result_path.read_text())
    d.mkdir(parents=True, exist_ok=True)
    cmd = command(sweep, run)
    env = {**os.environ, **sweep.env}
    start = time.perf_counter()
    with open(d / "output.log", "w") as logfile:
        proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env=env)
        # wait4 gives this child's own resource usage: ru_maxrss is its peak RSS (KiB on Linux)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    result = {"returncode": proc.returncode, "wall_s": time.perf_counter() - start,
              "peak_rss_mb": usage.ru_maxrss / 1024, "command": cmd}
    if proc.returncode == 0:
        result_path.write_text(json.dumps(result, indent=2))
    else:
        log.warning("sweep run %s failed (exit %d): see %s", run.name, proc.returncode, d / "output.log")
    return result


# ------------------------------------------------------------------ collecting
def read_records(sweep: Sweep, run: Run) -> list[dict]:
    path = run_dir(sweep, run) / "tb" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: forward + backward, no recomputation (the MFU convention)."""
    T = cfg.data.seq_len
    return summarize(flop_rows(cfg.model, T, cfg.train.checkpointing), T)["model"] / T


def predicted_peak_bytes(cfg: Config, device: str = "cpu") -> float:
    on_cpu = device == "cpu"
    layout = Layout.from_config(cfg, fused_rms_norm=not on_cpu, foreach_optimizer=not on_cpu)
    return max(estimate_memory(cfg.model, layout, s).peak for s in range(layout.pp))


def summarize_run(sweep: Sweep, run: Run, result: dict) -> dict:
    cfg = run.config
    records = [r for r in read_records(sweep, run) if "train/loss" in r]
    evals = [r["eval/loss"] for r in read_records(sweep, run) if "eval/loss" in r]
    fpt = flops_per_token(cfg)
    speeds = [r["train/tokens_per_s"] for r in records[1:] or records]  # the first window warms up
    tokens = records[-1]["train/tokens"] if records else 0
    return {
        "run": run.name, "label": run.label, **{k: v for k, v in run.values.items()},
        "params": _param_counts(cfg)["total"],
        "flops_per_token": fpt, "steps": records[-1]["step"] if records else 0, "tokens": tokens,
        "compute_flops": fpt * tokens,
        "final_loss": trailing_mean([r["train/loss"] for r in records], sweep.smooth)[-1] if records
        else float("nan"),
        "last_loss": records[-1]["train/loss"] if records else float("nan"),
        "eval_loss": evals[-1] if evals else float("nan"),
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else float("nan"),
        "peak_rss_mb": result.get("peak_rss_mb", float("nan")),
        # a trainer that logs its device peak (e.g. torch.cuda.max_memory_allocated) wins over RSS
        "peak_memory_mb": max((r[PEAK_METRIC] for r in records if PEAK_METRIC in r), default=float("nan")) / 2 ** 20,
        "predicted_step_mb": predicted_peak_bytes(cfg) / 2 ** 20,
        "wall_s": result.get("wall_s", float("nan")),
        "status": "ok" if result.get("returncode") == 0 else f"exit {result.get('returncode')}",
    }


def _param_counts(cfg: Config) -> dict[str, int]:
    from rlt_mega.model.rlt import param_counts

    return param_counts(cfg.model)


def write_csv(rows: list[dict], path: Path) -> None:
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def plot(sweep: Sweep, path: Path, title: Optional[str] = None) -> None:
    """Training loss against compute, one line per run (log-scale compute)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for run in sweep.runs:
        records = [r for r in read_records(sweep, run) if "train/loss" in r]
        if not records:
            continue
        fpt = flops_per_token(run.config)
        ax.plot([r["train/tokens"] * fpt for r in records],
                trailing_mean([r["train/loss"] for r in records], sweep.smooth), label=run.label, linewidth=1.5)
    ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs, forward + backward)")
    ax.set_ylabel("training loss" + (f" (mean of {sweep.smooth} logged steps)" if sweep.smooth > 1 else ""))
    ax.set_title(title or sweep.title or f"sweep {sweep.out.name}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_sweep(sweep: Sweep, force: bool = False, only_collect: bool = False) -> list[dict]:
    """Runs (or only collects) every configuration; writes results.csv and loss_vs_compute.png."""
    sweep.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, run in enumerate(sweep.runs, 1):
        if only_collect:
            path = run_dir(sweep, run) / "result.json"
            result = json.loads(path.read_text()) if path.exists() else {"returncode": None}
        else:
            log.info("sweep run %d/%d: %s", i, len(sweep.runs), run.name)
            result = execute(sweep, run, force)
        rows.append(summarize_run(sweep, run, result))
    write_csv(rows, sweep.out / "results.csv")
    plot(sweep, sweep.out / "loss_vs_compute.png")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="the sweep YAML file")
    parser.add_argument("--force", action="store_true", help="rerun runs that already have a result")
    parser.add_argument("--collect", action="store_true", help="only collect existing runs into CSV and plot")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.spec)
    except ConfigError as exc:
        sys.stderr.write(f"sweep: error: {exc}\n")
        return 2
    if args.dry_run:
        for run in sweep.runs:
            sys.stdout.write(" ".join(command(sweep, run)) + "\n")
        return 0
    rows = run_sweep(sweep, force=args.force, only_collect=args.collect)
    for row in rows:
        sys.stdout.write(f"{row['label']:<28} loss {row['final_loss']:.4f}  {row['tokens_per_s']:9.0f} tok/s  "
                         f"{row['compute_flops']:.3g} FLOPs  peak RSS {row['peak_rss_mb']:.0f} MB  {row['status']}\n")
    sys.stdout.write(f"wrote {sweep.out / 'results.csv'} and {sweep.out / 'loss_vs_compute.png'}\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1
