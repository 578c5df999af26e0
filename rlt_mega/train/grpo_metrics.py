"""A GRPO step's metrics, reduced over every rank.

Replica totals (rewards, completion lengths, positions the learner ran) come from each
replica's source rank (parallel/dims.py, ``is_replica_source``); the learner's per-token
metrics from the loss ranks (``is_loss_rank``), one record per batch (learner/objective.py);
phase times are the slowest rank's. Means are taken after the reduction: sums / global counts,
never a mean of means.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rlt_mega.rollout import Rollout
from rlt_mega.parallel.dims import ParallelDims

INF = float("inf")


def reduce_step_metrics(dims: ParallelDims, rewards: Sequence[float], failures: int, rollouts: Sequence[Rollout],
                        records: Sequence[dict], first_records: int, epochs: int, t_generate: float, t_learn: float,
                        with_reference: bool, learned: Optional[Sequence[Rollout]] = None,
                        per_row: Optional[dict[str, float]] = None,
                        totals: Optional[dict[str, float]] = None, with_correction: bool = False,
                        lags: Optional[dict[int, int]] = None) -> dict[str, float]:
    """rewards: this replica's, one per row; rollouts: its micro-batches of the step; records:
    the objective's per-part metrics on a loss rank (empty elsewhere), the first
    ``first_records`` of them the on-policy minibatch (epoch 0, minibatch 0). learned: the
    rollout batches the learner ran, every epoch (default: rollouts, epochs times); per_row:
    replica sums (nonzero on the replica source only) reported per sampled row, by name;
    totals: the same, reported summed over the replicas. with_correction: the records carry the
    off-policy correction's sums (learner/objective.py, ``correction_metrics``). lags: policy
    version -> its lag at this step (the versions the step's tokens may come from): the
    staleness of the learned tokens, by each token's own version, and the ratio per lag
    (``async/*``; records carry ``by_version``)."""
    src = 1.0 if dims.is_replica_source else 0.0
    sums = {
        "rows": src * len(rewards),
        "reward": src * sum(rewards),
        "correct": src * sum(r >= 1.0 for r in rewards),
        "failures": src * failures,
        "completion_tokens": src * sum(ro.num_completion_tokens() for ro in rollouts),
        "stopped": src * sum(f != "length" for ro in rollouts for f in ro.finish_reasons),
        # sequence positions (prompt + completion) the learner ran through replay and dense
        "learner_positions": src * (epochs * sum(ro.batch_size * ro.schedule.num_steps for ro in rollouts)
                                    if learned is None else
                                    sum(ro.batch_size * ro.schedule.num_steps for ro in learned)),
        **(per_row or {}),
        **(totals or {}),
    }
    mins: dict[str, float] = {"ratio_min": INF, "first_ratio_min": INF, "rho_min": INF}
    maxs: dict[str, float] = {"ratio_max": -INF, "first_ratio_max": -INF, "diff_max": -INF, "rho_max": -INF,
                              "t_generate": t_generate, "t_learn": t_learn}
    with_env = any(ro.episodes is not None for ro in rollouts)  # the same on every rank (grpo.env)
    if with_env:
        episodes = [e for ro in rollouts for e in ro.episodes]
        sums.update({"env_turns": src * sum(e.turns for e in episodes),
                     "env_tool_calls": src * sum(e.tool_calls for e in episodes),
                     "env_tool_errors": src * sum(e.tool_errors for e in episodes),
                     "env_observation_tokens": src * sum(e.observation_tokens for e in episodes),
                     "env_truncated": src * sum(e.truncated for e in episodes),
                     "env_departures": src * sum(e.departures for e in episodes),
                     "env_blocking_waits": src * sum(e.blocking_waits for e in episodes),
                     "env_faults": src * sum(e.faults for e in episodes)})
        maxs["env_observation_tokens_max"] = max((e.observation_tokens for e in episodes), default=0)
    learner = {k: 0.0 for k in ("tokens", "ratio_sum", "clipped", "support_miss", "kl_sum", "diff_sum",
                                "miss_dense_sum", "first_tokens", "first_kl_sum",
                                "entropy_sum", "rho_sum", "is_weight_sum", "is_rejected")}
    if dims.is_loss_rank:
        for i, m in enumerate(records):
            n = m["num_tokens"]
            learner["tokens"] += n
            learner["ratio_sum"] += m["ratio_sum"]
            learner["clipped"] += m["clipped"]
            learner["support_miss"] += m["support_miss"]
            learner["kl_sum"] += m["kl_sum"]
            learner["entropy_sum"] += m.get("entropy_sum", 0.0)
            learner["diff_sum"] += m["logprob_diff_mean"] * n
            learner["miss_dense_sum"] += m["support_miss_dense"] * n
            if n:
                mins["ratio_min"] = min(mins["ratio_min"], m["ratio_min"])
                maxs["ratio_max"] = max(maxs["ratio_max"], m["ratio_max"])
            maxs["diff_max"] = max(maxs["diff_max"], m["logprob_diff_max"])
            if with_correction and "rho_sum" in m:  # (a batch that kept no row carries no proximal: no tokens)
                for key in ("rho_sum", "is_weight_sum", "is_rejected"):
                    learner[key] += m[key]
                if n:
                    mins["rho_min"] = min(mins["rho_min"], m["rho_min"])
                    maxs["rho_max"] = max(maxs["rho_max"], m["rho_max"])
            if i < first_records:
                learner["first_tokens"] += n
                # KL(mu || dense) on the on-policy minibatch only: later ones were sampled before an
                # update, so theirs would mix the policy's own drift into the schedule mismatch.
                learner["first_kl_sum"] += m["kl_mu_dense"] * n
                if n:
                    mins["first_ratio_min"] = min(mins["first_ratio_min"], m["ratio_min"])
                    maxs["first_ratio_max"] = max(maxs["first_ratio_max"], m["ratio_max"])
    for v in lags or {}:
        sums[f"v{v}_n"], sums[f"v{v}_ratio_sum"] = 0.0, 0.0
        mins[f"v{v}_ratio_min"], maxs[f"v{v}_ratio_max"] = INF, -INF
        for m in records if dims.is_loss_rank else ():
            if v in m.get("by_version", {}):
                x = m["by_version"][v]
                sums[f"v{v}_n"] += x["n"]
                sums[f"v{v}_ratio_sum"] += x["sum"]
                mins[f"v{v}_ratio_min"] = min(mins[f"v{v}_ratio_min"], x["min"])
                maxs[f"v{v}_ratio_max"] = max(maxs[f"v{v}_ratio_max"], x["max"])
    sums.update(learner)
    r = dims.reduce(sums, mins, maxs)
    rows, tokens = max(r["rows"], 1.0), max(r["tokens"], 1.0)
    first_min = r["first_ratio_min"] if r["first_ratio_min"] != INF else 1.0
    first_max = r["first_ratio_max"] if r["first_ratio_max"] != -INF else 1.0
    out = {
        "reward/mean": r["reward"] / rows,
        "reward/accuracy": r["correct"] / rows,
        "reward/failures": r["failures"],
        "completion/length_mean": r["completion_tokens"] / rows,
        "completion/stopped_fraction": r["stopped"] / rows,
        "ratio/min": r["ratio_min"] if r["ratio_min"] != INF else 1.0,
        "ratio/mean": r["ratio_sum"] / tokens,
        "ratio/max": r["ratio_max"] if r["ratio_max"] != -INF else 1.0,
        "ratio/clip_fraction": r["clipped"] / tokens,
        "ratio/onpolicy_max_dev": max(abs(first_max - 1.0), abs(first_min - 1.0)),
        "support/miss_fraction": r["support_miss"] / tokens,
        "mismatch/logprob_diff_max": max(r["diff_max"], 0.0),
        "mismatch/logprob_diff_mean": r["diff_sum"] / tokens,
        "mismatch/kl_mu_dense": r["first_kl_sum"] / max(r["first_tokens"], 1.0),
        "mismatch/support_miss_dense": r["miss_dense_sum"] / tokens,
        # every replica's completions per second of the (slowest rank's) generate phase
        "perf/rollout_tokens_per_s": r["completion_tokens"] / max(r["t_generate"], 1e-9),
        "perf/learner_tokens_per_s": r["learner_positions"] / max(r["t_learn"], 1e-9),
    }
    out["policy/entropy"] = r["entropy_sum"] / tokens  # the dense policy's, under the rollout's processing
    out.update({name: r[name] / rows for name in per_row or {}})
    out.update({name: r[name] for name in totals or {}})
    if with_reference:
        out["kl/reference"] = r["kl_sum"] / tokens
    if with_env:  # per sampled row, tool errors per tool call; the max over every row of the step
        out.update({"env/turns": r["env_turns"] / rows, "env/tool_calls": r["env_tool_calls"] / rows,
                    "env/tool_errors": r["env_tool_errors"] / max(r["env_tool_calls"], 1.0),
                    "env/observation_tokens": r["env_observation_tokens"] / rows,
                    "env/observation_tokens_max": r["env_observation_tokens_max"],
                    "env/truncated": r["env_truncated"] / rows,
                    # calls per completion that ran while the row was out of the batch (its slot given to
                    # another row), and that the rollout waited for at once, no other row able to run
                    "env/departures": r["env_departures"] / rows,
                    "env/blocking_waits": r["env_blocking_waits"] / rows,
                    "env/faults": r["env_faults"]})  # the environment's code failing (rollout/env/base.py)
    if with_correction:  # rho = pi_old / mu, the policy change since the samples were drawn
        out.update({"is/rho_min": r["rho_min"] if r["rho_min"] != INF else 1.0, "is/rho_mean": r["rho_sum"] / tokens,
                    "is/rho_max": r["rho_max"] if r["rho_max"] != -INF else 1.0,
                    "is/weight_mean": r["is_weight_sum"] / tokens, "is/rejected_fraction": r["is_rejected"] / tokens})
    if lags:
        out.update(staleness_metrics(r, lags))
    return out


def staleness_metrics(r: dict[str, float], lags: dict[int, int]) -> dict[str, float]:
    """From the reduced per-version sums: the learned tokens' mean and largest lag, and the
    ratio's min/mean/max per lag present (a lag without tokens is not logged)."""
    present = {v: L for v, L in lags.items() if r[f"v{v}_n"] > 0}
    n = sum(r[f"v{v}_n"] for v in present)
    out = {"async/staleness_mean": sum(L * r[f"v{v}_n"] for v, L in present.items()) / n if n else 0.0,
           "async/staleness_max": float(max(present.values(), default=0))}
    for v, L in present.items():
        out.update({f"async/lag{L}/ratio_min": r[f"v{v}_ratio_min"],
                    f"async/lag{L}/ratio_mean": r[f"v{v}_ratio_sum"] / r[f"v{v}_n"],
                    f"async/lag{L}/ratio_max": r[f"v{v}_ratio_max"]})
    return out
