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
    seeds: [0, 1, 2]                  # optional: every point trained once per train.seed
    budgets: [2.0e12, 8.0e12]         # optional: iso-compute, training FLOPs per run (below)
    family: "{size}"                  # optional: what a power-law fit groups (default model.arch)

A *point* is one combination of the grid's axes (and budget); with ``seeds`` it is trained once
per seed and reported as the mean and the standard deviation over its seeds (points.csv). With
``budgets`` every point is trained to the same training compute: its steps are the budget over
the cost model's training FLOPs per token times the tokens of a step (rounded, at least 1),
so a family that costs more per token trains on fewer tokens. Per family the losses are fitted
by a power law ``loss = a * compute^(-alpha)`` (least squares in log-log over every run of the
family; fits.json), and the plot shows the families in one figure: the points with their
spread, the fitted lines, and each point's training curve (mean over seeds).

Each run is ``<launcher> pretrain --config <base> <overrides> <axis overrides>`` in a
subprocess, with logging.dir and checkpoint.dir inside its own directory; a run whose
``result.json`` exists is not run again (a sweep can be resumed). Compute is the cost
model's training FLOPs per token (forward + backward, no recomputation: the MFU
convention) times the tokens trained. Peak memory: ``peak_rss_mb`` is the peak resident set size
of the run's process tree as the sweep sees it, ``peak_memory_mb`` the trainer's own
``train/peak_memory_bytes`` (rank 0: torch.cuda.max_memory_allocated on a GPU, the process's peak
RSS elsewhere, rlt_mega.metrics.peak_memory_bytes), beside the cost model's prediction for the
step itself (``predicted_step_mb``).

With ``eval.lengths`` (a generated state-tracking task, rlt_mega/data/state_tasks.py) every run's
row also holds its last evaluation's per-position and whole-sequence accuracy at each length
(columns ``token_acc@T``, ``seq_acc@T``), points.csv their mean and spread, and
``accuracy_vs_length.png`` plots them against the length, one line per point.

``--dry-run`` prints each run's command and the cost model's and the planner's estimate for it
(parameters, training FLOPs, steps, predicted step memory, the planner's step time on one GPU of
its default hardware); ``--set KEY=VALUE`` adds overrides to every run (a cluster-scale version
of a CPU sweep: width, depth, lengths), after the spec's own, ``--budgets`` replaces its
budgets and ``--out`` its directory, so ``--dry-run --set ... --budgets ...`` shows how the estimate scales before anything runs.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from rlt_mega.checkpoint import OutputKind, check_output
from rlt_mega.config import Config, ConfigError, load_config, read_yaml
from rlt_mega.log import get_logger
from rlt_mega.cost.flops import flop_rows, summarize
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.memory import estimate_memory
from rlt_mega.cost.sweep_stats import power_law_fit  # noqa: F401 (re-exported)
from rlt_mega.cost.sweep_stats import (ACCURACY_KINDS, accuracy_lengths, aggregate, fit_families, fit_metric,
                                       markdown, report)

log = get_logger(__name__)

PEAK_METRIC = "train/peak_memory_bytes"
SWEEP_KEYS = {"base", "out", "overrides", "grid", "label", "launcher", "env", "title", "smooth", "seeds", "budgets",
              "family"}
SEED_AXIS, BUDGET_AXIS = "seed", "budget"


@dataclass
class Run:
    name: str  # directory name
    label: str  # legend
    overrides: list[str]  # the run's own (axis) overrides
    values: dict[str, Any]  # axis -> value (a mapping's name for mapping axes)
    config: Optional[Config] = None
    point: str = ""  # the run's point: its name without the seed
    family: str = ""  # what the power-law fit groups
    seed: Optional[int] = None
    budget: Optional[float] = None  # training FLOPs (iso-compute), None: the config's steps


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
    seeds: list[int] = field(default_factory=list)
    budgets: list[float] = field(default_factory=list)


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


def expand(spec: dict, base_dir: Path = Path("."), extra: Optional[list[str]] = None) -> Sweep:
    """The runs of a sweep spec (a parsed YAML mapping), each config loaded and validated;
    ``extra`` overrides (``--set``) follow the spec's own."""
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise ConfigError(f"unknown sweep key(s) {sorted(unknown)}; valid keys: {sorted(SWEEP_KEYS)}")
    if "base" not in spec or "grid" not in spec:
        raise ConfigError("a sweep needs 'base' (a config file) and 'grid' (axes of values)")
    base = str(spec["base"])
    overrides = [str(o) for o in spec.get("overrides", [])] + list(extra or [])
    grid = spec["grid"]
    if not isinstance(grid, dict) or not grid:
        raise ConfigError("sweep 'grid' must be a mapping of axis -> list of values")
    for reserved in (SEED_AXIS, BUDGET_AXIS):
        if reserved in grid:
            raise ConfigError(f"sweep grid axis '{reserved}' is reserved: use the sweep key "
                              f"'{reserved}s' ({reserved}s: [...]) instead")
    seeds = _int_list(spec.get("seeds", []), "seeds")
    budgets = _budget_list(spec.get("budgets", []))
    axes = {axis: _axis_points(axis, values) for axis, values in grid.items()}
    runs = []
    for combo in itertools.product(*axes.values()):
        values = {axis: point[0] for axis, point in zip(axes, combo)}
        grid_overrides = [o for point in combo for o in point[1]]
        for budget in budgets or [None]:
            for seed in seeds or [None]:
                runs.append(_make_run(spec, base, overrides, values, grid_overrides, budget, seed))
    if len({r.name for r in runs}) != len(runs):
        raise ConfigError("two sweep runs have the same name: give mapping axes distinct 'name's")
    out = Path(spec.get("out", "runs/sweep"))
    return Sweep(base=base, out=out if out.is_absolute() else base_dir / out, overrides=overrides, runs=runs,
                 launcher=[str(x) for x in spec.get("launcher", ["{python}", "-m", "rlt_mega"])],
                 env={str(k): str(v) for k, v in spec.get("env", {}).items()},
                 title=spec.get("title"), smooth=_positive_int(spec.get("smooth", 1), "smooth"),
                 seeds=seeds, budgets=budgets)


def _make_run(spec: dict, base: str, overrides: list[str], values: dict[str, Any], grid_overrides: list[str],
              budget: Optional[float], seed: Optional[int]) -> Run:
    """One run: the grid point's overrides, then the budget's steps and the seed."""
    point_values = dict(values)
    if budget is not None:
        point_values[BUDGET_AXIS] = f"{budget:.3g}"
    point = _name(point_values)
    run_values = {**point_values, **({SEED_AXIS: seed} if seed is not None else {})}
    name = _name(run_values)
    run_overrides = list(grid_overrides) + ([f"train.seed={seed}"] if seed is not None else [])
    try:
        cfg = load_config(base, overrides + run_overrides)
        if budget is not None:
            steps = steps_for_budget(cfg, budget)
            run_overrides.append(f"train.steps={steps}")
            cfg = load_config(base, overrides + run_overrides)
    except ConfigError as exc:
        raise ConfigError(f"sweep run {name}: {exc}") from None
    label = _label(spec.get("label"), point_values)
    family = _label(spec["family"], point_values) if spec.get("family") else cfg.model.arch
    return Run(name, label, run_overrides, run_values, cfg, point=point, family=family, seed=seed, budget=budget)


def _name(values: dict[str, Any]) -> str:
    return "__".join(f"{_short(a)}={re.sub(r'[^A-Za-z0-9_.-]', '_', str(v))}" for a, v in values.items())


def tokens_per_step(cfg: Config) -> int:
    """Input tokens of one optimizer step over every data-parallel replica (the trainer's count)."""
    return cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len * (cfg.parallel.dp or 1)


def steps_for_budget(cfg: Config, budget: float) -> int:
    """The steps that spend ``budget`` training FLOPs (the cost model's, forward + backward)."""
    return max(1, round(budget / (flops_per_token(cfg) * tokens_per_step(cfg))))


def _int_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"sweep '{key}' must be a list of integers, got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"sweep '{key}' lists a value twice: {value}")
    return value


def _budget_list(value: Any) -> list[float]:
    """Positive FLOPs; strings too, since YAML reads 1.2e10 (no sign in the exponent) as one."""
    def number(v: Any) -> float:
        if isinstance(v, bool):
            return float("nan")
        try:
            return float(v)
        except (TypeError, ValueError):
            return float("nan")
    budgets = [number(v) for v in value] if isinstance(value, list) else [float("nan")]
    if not all(math.isfinite(b) and b > 0 for b in budgets):
        raise ConfigError(f"sweep 'budgets' must be a list of positive training FLOPs (e.g. [2.0e12]), "
                          f"got {value!r}")
    if len(set(budgets)) != len(budgets):
        raise ConfigError(f"sweep 'budgets' lists a value twice: {value}")
    return budgets


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"sweep '{name}' must be a positive integer, got {value!r}")
    return value


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values up to each point."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window))
            for i in range(len(values))]


def load_sweep(path: str | Path, extra: Optional[list[str]] = None, budgets: Optional[list[float]] = None,
               out: Optional[str] = None) -> Sweep:
    """The sweep of a YAML file; ``extra`` overrides follow its own, ``budgets`` and ``out``
    replace its own."""
    spec = read_yaml(path)
    if budgets:
        spec["budgets"] = budgets
    if out:
        spec["out"] = out
    return expand(spec, extra=extra)


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
    # an interrupted attempt is rerun (its tb/ and checkpoints/ removed below): only a sweep run's own
    # directory (with output.log) or an empty one, never a folder of other files that has the run's name
    if not (d / LOCK_NAME).exists():  # (a lock: another sweep process's run, output.log not yet opened)
        check_output(d, [sweep.base], overwrite=True, kind=SWEEP_RUN)
    d.mkdir(parents=True, exist_ok=True)
    if not _claim(d / LOCK_NAME):
        log.info("sweep run %s: another sweep process is running it (%s); skipped", run.name, d / LOCK_NAME)
        return {"returncode": None}
    try:
        for partial in ("tb", "checkpoints"):  # an interrupted attempt's: the trainer would append to them
            shutil.rmtree(d / partial, ignore_errors=True)
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
    finally:
        (d / LOCK_NAME).unlink(missing_ok=True)


LOCK_NAME = "running.lock"
SWEEP_RUN = OutputKind("a sweep run's directory", "output.log")  # execute opens output.log before the run starts


def _claim(lock: Path) -> bool:
    """Takes a run for this process (several sweep processes may share one directory): the lock
    file holds the owner's pid; a lock whose process is gone (a killed sweep) is taken over."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                owner = int(lock.read_text().strip() or 0)
                os.kill(owner, 0)
                return False  # alive: its run
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)  # stale
                continue
            except PermissionError:
                return False
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


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
    layout = Layout.from_config(cfg, fused_rms_norm=not on_cpu, foreach_optimizer=not on_cpu, onednn_weights=on_cpu)
    return max(estimate_memory(cfg.model, layout, s).peak for s in range(layout.pp))


def summarize_run(sweep: Sweep, run: Run, result: dict) -> dict:
    cfg = run.config
    records = [r for r in read_records(sweep, run) if "train/loss" in r]
    eval_records = [r for r in read_records(sweep, run) if "eval/loss" in r]
    evals = [r["eval/loss"] for r in eval_records]
    accuracy = {f"{kind}@{n}": eval_records[-1].get(f"eval/{kind}@{n}", float("nan")) if eval_records
                else float("nan") for n in cfg.eval.lengths for kind in ACCURACY_KINDS}
    fpt = flops_per_token(cfg)
    speeds = [r["train/tokens_per_s"] for r in records[1:] or records]  # the first window warms up
    tokens = records[-1]["train/tokens"] if records else 0
    return {
        "run": run.name, "label": run.label, "point": run.point or run.name, "family": run.family,
        "arch": cfg.model.arch, **{k: v for k, v in run.values.items()},
        "budget_flops": run.budget if run.budget is not None else float("nan"),
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
        **accuracy,
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


# ------------------------------------------------------------------ plot
def plot(sweep: "Sweep | list[Sweep]", path: Path, title: Optional[str] = None,
         rows: Optional[list[dict]] = None) -> None:
    """The families in one figure (log-scale compute): each point's mean training curve (thin),
    its final loss with the spread over seeds (marker and error bar) and each family's fitted
    power law (dashed), one colour per family. Several sweeps: their runs together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = sweep if isinstance(sweep, list) else [sweep]
    pairs = [(s, r) for s in sweeps for r in s.runs]
    sweep = sweeps[0]  # smoothing and title
    rows = rows if rows is not None else [summarize_run(s, r, {"returncode": 0}) for s, r in pairs]
    metric = fit_metric(rows)
    points = aggregate(rows)
    fits = fit_families(rows)
    families = list(dict.fromkeys(r.family for _, r in pairs))
    colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    _plot_curves(ax, pairs, colours, sweep.smooth)
    _plot_fits(ax, families, points, fits, metric, colours)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute (FLOPs, forward + backward)")
    what = "held-out loss" if metric == "eval_loss" else "final training loss"
    ax.set_ylabel(f"{what}; curves: training loss" + (f" (mean of {sweep.smooth})" if sweep.smooth > 1 else ""))
    ax.set_title(title or sweep.title or f"sweep {sweep.out.name}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_curves(ax, pairs: list, colours: dict, smooth: int) -> None:
    """Each point's mean training curve over its seeds (thin), loss against compute."""
    for point in dict.fromkeys((id(s), r.point or r.name) for s, r in pairs):
        runs = [(s, r) for s, r in pairs if (id(s), r.point or r.name) == point]
        curves = [[(rec["train/tokens"] * flops_per_token(r.config), rec["train/loss"])
                   for rec in read_records(s, r) if "train/loss" in rec] for s, r in runs]
        curves = [c for c in curves if c]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        xs = [curves[0][i][0] for i in range(n)]
        ys = trailing_mean([sum(c[i][1] for c in curves) / len(curves) for i in range(n)], smooth)
        ax.plot(xs, ys, color=colours[runs[0][1].family], linewidth=0.8, alpha=0.35)


def _plot_fits(ax, families: list, points: list, fits: dict, metric: str, colours: dict) -> None:
    """Each family's final losses with their spread over seeds and its fitted power law."""
    for family in families:
        ps = [p for p in points if p["family"] == family and math.isfinite(p[metric])]
        if not ps:
            continue
        fit = fits[family]
        name = family + (f" (alpha={fit['alpha']:.3f})" if math.isfinite(fit["alpha"]) else "")
        ax.errorbar([p["compute_flops"] for p in ps], [p[metric] for p in ps], yerr=[p[metric + "_std"] for p in ps],
                    fmt="o", color=colours[family], markersize=4, capsize=3, label=name)
        if math.isfinite(fit["alpha"]):
            lo, hi = fit["compute_min"], fit["compute_max"]
            xs = [lo * (hi / lo) ** (i / 20) for i in range(21)]
            ax.plot(xs, [fit["a"] * x ** -fit["alpha"] for x in xs], "--", color=colours[family], linewidth=1.2)


def plot_accuracy(rows: list[dict], path: Path, title: Optional[str] = None) -> None:
    """Accuracy against evaluation length (log2 axis), one line per point (mean over seeds, the
    spread as error bars), one colour per family: per-position accuracy on the left,
    whole-sequence accuracy on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = accuracy_lengths(rows)
    points = aggregate(rows)
    families = list(dict.fromkeys(p["family"] for p in points))
    colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.2), dpi=100)
    for ax, kind, what in zip(axes, ACCURACY_KINDS, ("per-position accuracy", "whole-sequence accuracy")):
        seen: dict[str, int] = {}
        for p in points:
            style = styles[seen.setdefault(p["family"], 0) % len(styles)]
            seen[p["family"]] += 1
            ax.errorbar(lengths, [p[f"{kind}@{n}"] for n in lengths], yerr=[p[f"{kind}@{n}_std"] for n in lengths],
                        color=colours[p["family"]], linestyle=style, marker="o", markersize=3, capsize=2,
                        linewidth=1.2, label=p["label"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("evaluation length (positions)")
        ax.set_ylabel(what)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title or "accuracy against evaluation length (mean +- std over seeds)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_sweep(sweep: Sweep, force: bool = False, only_collect: bool = False) -> list[dict]:
    """Runs (or only collects) every configuration; writes results.csv (one row per run),
    points.csv (per point: mean and spread over seeds), fits.json (per family) and
    loss_vs_compute.png (and accuracy_vs_length.png with eval.lengths)."""
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
    write_csv(aggregate(rows), sweep.out / "points.csv")
    (sweep.out / "fits.json").write_text(json.dumps(fit_families(rows), indent=2))
    plot(sweep, sweep.out / "loss_vs_compute.png", rows=rows)
    if accuracy_lengths(rows):
        plot_accuracy(rows, sweep.out / "accuracy_vs_length.png", sweep.title)
    return rows


def estimate_run(run: Run) -> dict:
    """What the cost model and the planner expect of one run before it runs: parameters,
    training FLOPs, steps, the predicted peak memory of a step (CPU layout), and the planner's
    step time on one GPU of its default hardware (planner.Hardware) with the run's layout."""
    from rlt_mega.cost.planner import Hardware, step_time

    cfg = run.config
    steps = cfg.train.steps
    # the planner's step-time model is the RLT's (encoder, decoder ring, cross-attention): none for baselines
    gpu_step = step_time(cfg.model, Layout.from_config(cfg), Hardware())["total"] if cfg.model.arch == "rlt" \
        else float("nan")
    return {"params": _param_counts(cfg)["total"], "flops_per_token": flops_per_token(cfg), "steps": steps,
            "train_flops": flops_per_token(cfg) * tokens_per_step(cfg) * steps,
            "predicted_step_mb": predicted_peak_bytes(cfg) / 2 ** 20, "gpu_step_s": gpu_step,
            "gpu_s": gpu_step * steps}


def dry_run(sweeps: list[Sweep], out) -> None:
    """Each run's command and estimate, then the totals."""
    from rlt_mega.cost.planner import Hardware

    hw = Hardware()
    total_flops = total_gpu_s = 0.0
    for sweep in sweeps:
        for run in sweep.runs:
            e = estimate_run(run)
            total_flops += e["train_flops"]
            total_gpu_s += e["gpu_s"] if math.isfinite(e["gpu_s"]) else 0.0
            out.write(" ".join(command(sweep, run)) + "\n")
            out.write(f"  # {run.name}: {e['params'] / 1e6:.3f} M params, {e['flops_per_token'] / 1e6:.3g} "
                      f"MFLOPs/token, {e['steps']} steps, {e['train_flops']:.3g} training FLOPs, step "
                      f"{e['predicted_step_mb']:.0f} MB "
                      "predicted; planner: " + (f"{e['gpu_step_s'] * 1e3:.3g} ms/step, {e['gpu_s']:.3g} s on one GPU\n"
                                                if math.isfinite(e["gpu_s"]) else "no step-time model for "
                                                f"arch={run.config.model.arch} (RLT only)\n"))
    out.write(f"{sum(len(s.runs) for s in sweeps)} runs, {total_flops:.3g} training FLOPs, planner: "
              f"{total_gpu_s / 3600:.3g} GPU-hours for the RLT runs on its default GPU "
              f"({hw.peak_tflops_bf16:g} bf16 TFLOP/s, {hw.gpu_mem_gb:g} GB, one per run)\n")


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="+", help="the sweep YAML file (several: each runs, then all are "
                                                "reported, fitted and plotted together into --combined)")
    parser.add_argument("--combined", help="with several specs: the directory of their joint CSVs, fits and plot")
    parser.add_argument("--title", help="the joint plot's title (default: the first spec's)")
    parser.add_argument("--force", action="store_true", help="rerun runs that already have a result")
    parser.add_argument("--collect", action="store_true", help="only collect existing runs into CSV and plot")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands with the cost model's and the planner's estimate per run, and exit")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run, after the spec's (repeatable; e.g. --set model.d_model=512)")
    parser.add_argument("--budgets", type=float, nargs="+", metavar="FLOPS",
                        help="training FLOPs per run, replacing the spec's budgets (e.g. a cluster's: --budgets 1e17)")
    parser.add_argument("--out", help="the runs' directory, replacing the spec's out (a run whose result exists there "
                                      "is not run again: give --set variants their own)")
    parser.add_argument("--markdown", action="store_true", help="print the points and fits as Markdown tables")
    args = parser.parse_args(argv)
    if len(args.spec) > 1 and not args.combined:
        parser.error("several sweep files need --combined DIR (where their joint results go)")
    try:
        if args.out and len(args.spec) > 1:
            raise ConfigError("--out names one sweep's directory: with several specs use --combined")
        sweeps = [load_sweep(spec, args.set, args.budgets, args.out) for spec in args.spec]
    except ConfigError as exc:
        sys.stderr.write(f"sweep: error: {exc}\n")
        return 2
    if args.dry_run:
        dry_run(sweeps, sys.stdout)
        return 0
    try:
        rows = [row for sweep in sweeps for row in run_sweep(sweep, force=args.force, only_collect=args.collect)]
    except FileExistsError as exc:  # a run's directory that is not a sweep run's (checkpoint.check_output)
        sys.stderr.write(f"sweep: error: {exc}\n")
        return 2
    out = sweeps[0].out
    if len(sweeps) > 1:
        out = Path(args.combined)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, out / "results.csv")
        write_csv(aggregate(rows), out / "points.csv")
        (out / "fits.json").write_text(json.dumps(fit_families(rows), indent=2))
        plot(sweeps, out / "loss_vs_compute.png", title=args.title, rows=rows)
        if accuracy_lengths(rows):
            plot_accuracy(rows, out / "accuracy_vs_length.png", args.title)
    sys.stdout.write(markdown(rows) if args.markdown else report(rows))
    sys.stdout.write(f"wrote {out / 'results.csv'}, points.csv, fits.json and loss_vs_compute.png"
                     + (" and accuracy_vs_length.png\n" if accuracy_lengths(rows) else "\n"))
    return 0 if all(r["status"] == "ok" for r in rows) else 1
