"""What a sweep's runs say together: each point's mean and spread over its seeds, a power law of
loss against compute per family, and the text and Markdown tables of both (cost/sweep.py runs
the sweep; these are pure functions of its rows, one dict per run)."""

from __future__ import annotations

import math

MEAN_FIELDS = ("final_loss", "last_loss", "eval_loss", "compute_flops", "tokens", "steps", "tokens_per_s",
               "peak_rss_mb", "peak_memory_mb", "predicted_step_mb", "wall_s")
ACCURACY_KINDS = ("token_acc", "seq_acc")  # eval.lengths: columns token_acc@T, seq_acc@T per length T


def accuracy_lengths(rows: list[dict]) -> list[int]:
    """The evaluation lengths the rows hold accuracy columns for, ascending."""
    return sorted({int(k.split("@")[1]) for r in rows for k in r if k.split("@")[0] in ACCURACY_KINDS})


def accuracy_fields(rows: list[dict]) -> list[str]:
    return [f"{kind}@{n}" for n in accuracy_lengths(rows) for kind in ACCURACY_KINDS]


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for one value) of the finite values."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not xs:
        return float("nan"), float("nan")
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per point (the runs of its seeds): the mean and the spread (sample std) of each
    measured field, in the order the points first appear."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["point"], []).append(row)
    points = []
    for point, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        first = rs[0]
        out = {"point": point, "label": first["label"], "family": first["family"], "arch": first["arch"],
               "budget_flops": first["budget_flops"], "params": first["params"],
               "flops_per_token": first["flops_per_token"], "seeds": len(ok),
               "failed": len(rs) - len(ok)}
        for key in MEAN_FIELDS + tuple(accuracy_fields(rows)):
            out[key], out[key + "_std"] = _mean_std([r.get(key, float("nan")) for r in ok])
        points.append(out)
    return points


def fit_metric(rows: list[dict]) -> str:
    """The loss the fits and the plot use: the held-out loss where every run has one, else the
    (smoothed) final training loss."""
    ok = [r for r in rows if r["status"] == "ok"]
    return "eval_loss" if ok and all(math.isfinite(r["eval_loss"]) for r in ok) else "final_loss"


MIN_COMPUTE_SPAN = 1.25  # a fit needs points at least this factor apart in compute


def power_law_fit(compute: list[float], loss: list[float]) -> dict:
    """Least squares of log(loss) = log(a) - alpha log(compute) -> {a, alpha, r2, n}; alpha nan
    when the points span less than MIN_COMPUTE_SPAN in compute."""
    pts = [(math.log(c), math.log(y)) for c, y in zip(compute, loss)
           if math.isfinite(c) and math.isfinite(y) and c > 0 and y > 0]
    n = len(pts)
    out = {"a": float("nan"), "alpha": float("nan"), "r2": float("nan"), "n": n,
           "compute_min": min((math.exp(x) for x, _ in pts), default=float("nan")),
           "compute_max": max((math.exp(x) for x, _ in pts), default=float("nan"))}
    if n < 2:
        return out
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if max(x for x, _ in pts) - min(x for x, _ in pts) < math.log(MIN_COMPUTE_SPAN):
        return out  # one compute value (iso-compute runs differ by rounding alone): no slope to fit
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    syy = sum((y - my) ** 2 for _, y in pts)
    resid = sum((y - (intercept + slope * x)) ** 2 for x, y in pts)
    out.update(a=math.exp(intercept), alpha=-slope, r2=1.0 - resid / syy if syy > 0 else 1.0)
    return out


def fit_families(rows: list[dict]) -> dict[str, dict]:
    """A power law of loss against compute per family, over every finished run of the family."""
    metric = fit_metric(rows)
    fits = {}
    for family in dict.fromkeys(r["family"] for r in rows):
        rs = [r for r in rows if r["family"] == family and r["status"] == "ok"]
        fits[family] = {"metric": metric, **power_law_fit([r["compute_flops"] for r in rs], [r[metric] for r in rs])}
    return fits


def report(rows: list[dict]) -> str:
    """The points (mean +- spread over seeds) and the fitted exponents, as text."""
    metric = fit_metric(rows)
    lines = [f"{'point':<34} {'seeds':>5} {metric + ' (mean +- std)':>24} {'compute':>10} {'steps':>6} "
             f"{'tok/s':>8} {'peak MB':>8}"]
    for p in aggregate(rows):
        lines.append(f"{p['label']:<34} {p['seeds']:>5} {p[metric]:>14.4f} +- {p[metric + '_std']:.4f} "
                     f"{p['compute_flops']:>10.3g} {p['steps']:>6.0f} {p['tokens_per_s']:>8.0f} "
                     f"{p['peak_memory_mb']:>8.0f}" + (f"  ({p['failed']} failed)" if p["failed"] else ""))
    lines.append(f"power-law fits, {metric} = a * compute^(-alpha), per family:")
    for family, fit in fit_families(rows).items():
        lines.append(f"  {family:<20} alpha {fit['alpha']:.4f}  a {fit['a']:.4g}  r2 {fit['r2']:.3f}  "
                     f"({fit['n']} runs, {fit['compute_min']:.3g}..{fit['compute_max']:.3g} FLOPs)")
    return "\n".join(lines) + "\n" + accuracy_table(rows)


def accuracy_table(rows: list[dict]) -> str:
    """Per point and evaluation length: the per-position and whole-sequence accuracy, mean +- std
    over seeds, as a Markdown table ("" without eval.lengths)."""
    lengths = accuracy_lengths(rows)
    if not lengths:
        return ""
    lines = ["", "| point | seeds | " + " | ".join(f"token acc @{n}" for n in lengths) + " | "
             + " | ".join(f"seq acc @{n}" for n in lengths) + " |", "|---|---|" + "---|" * (2 * len(lengths))]
    for p in aggregate(rows):
        cells = [f"{p[f'{kind}@{n}']:.3f} +- {p[f'{kind}@{n}_std']:.3f}" for kind in ACCURACY_KINDS for n in lengths]
        lines.append(f"| {p['label']} | {p['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict]) -> str:
    """The points and the fits as Markdown tables (for a README)."""
    metric = fit_metric(rows)
    name = "eval loss" if metric == "eval_loss" else "final training loss"
    lines = [f"| point | params | train FLOPs/token | steps | tokens | compute | {name} (mean +- std) | "
             "tokens/s | peak memory |", "|---|---|---|---|---|---|---|---|---|"]
    for p in aggregate(rows):
        lines.append(f"| {p['label']} | {p['params'] / 1e6:.2f} M | {p['flops_per_token'] / 1e6:.2f} M | "
                     f"{p['steps']:.0f} | {p['tokens']:,.0f} | {p['compute_flops']:.3g} | "
                     f"{p[metric]:.3f} +- {p[metric + '_std']:.3f} (n={p['seeds']}) | {p['tokens_per_s']:.0f} | "
                     f"{p['peak_memory_mb']:.0f} MB |")
    lines += ["", f"| family | alpha ({name} = a * compute^-alpha) | a | r2 | runs | compute range |",
              "|---|---|---|---|---|---|"]
    for family, fit in fit_families(rows).items():
        lines.append(f"| {family} | {fit['alpha']:.4f} | {fit['a']:.4g} | {fit['r2']:.3f} | {fit['n']} | "
                     f"{fit['compute_min']:.3g} .. {fit['compute_max']:.3g} |")
    return "\n".join(lines) + "\n" + accuracy_table(rows)
