"""A GRPO step's metrics, reduced over every rank.

Replica totals (rewards, completion lengths, positions the learner ran) come from each
replica's source rank (parallel/dims.py, ``is_replica_source``); the learner's per-token
metrics from the loss ranks (``is_loss_rank``), one record per batch (learner/objective.py);
phase times are the slowest rank's. Means are taken after the reduction: sums / global counts,
never a mean of means. Each part below gathers its sums, minima and maxima; one reduction
serves them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from rlt_mega.config import GRPOConfig
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.rollout import Rollout

if TYPE_CHECKING:
    from rlt_mega.train.async_grpo import Generated
    from rlt_mega.train.grpo_learn import Learned

INF = float("inf")
LEARNER_SUMS = ("tokens", "ratio_sum", "clipped", "support_miss", "kl_sum", "diff_sum", "miss_dense_sum",
                "first_tokens", "first_kl_sum", "entropy_sum", "rho_sum", "is_weight_sum", "is_rejected")


class Parts:
    """The sums, minima and maxima of a step before their one reduction."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def low(self, key: str, x: float) -> None:
        self.mins[key] = min(self.mins.get(key, INF), x)

    def high(self, key: str, x: float) -> None:
        self.maxs[key] = max(self.maxs.get(key, -INF), x)


def step_metrics(dims: ParallelDims, g: GRPOConfig, item: "Generated", learned: "Learned", lags: dict[int, int],
                 with_reference: bool, with_correction: bool) -> dict[str, float]:
    """Data step ``item`` learned as ``learned``. lags: policy version -> its lag at this step
    (the versions the step's tokens may come from): the staleness of the learned tokens, by each
    token's own version, and the ratio per lag (``async/*``; records carry ``by_version``).
    with_correction: the records carry the off-policy correction's sums (learner/objective.py)."""
    src = 1.0 if dims.is_replica_source else 0.0
    rounds = item.rounds
    rollouts = [ro for rnd in rounds for ro in rnd.flat]
    per_row = {}  # replica sums, reported per sampled row
    if g.overlong_buffer:
        per_row["reward/overlong_penalty"] = src * sum(x for rnd in rounds for x in rnd.penalties)
    if g.kl_in_reward:
        per_row["kl/reward_penalty"] = src * sum(float(rnd.kl_penalties.sum()) for rnd in rounds)
    totals = {k: src * v for k, v in item.sampling.items()} if g.dynamic_sampling else {}  # over every replica
    totals["reward/nonfinite"] = src * sum(rnd.nonfinite for rnd in rounds)
    parts = Parts()
    _replica_sums(parts, src, [x for rnd in rounds for x in rnd.scores], sum(rnd.failures for rnd in rounds),
                  rollouts, learned.rollouts)
    parts.sums.update({**per_row, **totals})
    parts.maxs.update({"t_generate": item.t_generate, "t_learn": learned.seconds})
    with_env = any(ro.episodes is not None for ro in rollouts)  # the same on every rank (grpo.env)
    if with_env:
        _env_sums(parts, src, rollouts)
    records = learned.records if dims.is_loss_rank else []
    _learner_sums(parts, records, learned.first_records, with_correction)
    _version_sums(parts, records, lags)
    r = dims.reduce(parts.sums, parts.mins, parts.maxs)
    out = _scalars(r)
    out.update(_onpolicy_scalars(r, learned, lags[item.version], with_correction))
    out.update({name: r[name] / max(r["rows"], 1.0) for name in per_row})
    out.update({name: r[name] for name in totals})
    if with_reference:
        out["kl/reference"] = r["kl_sum"] / max(r["tokens"], 1.0)
    if with_env:
        out.update(_env_scalars(r))
    if with_correction:
        out.update(_correction_scalars(r))
    if lags:
        out.update(staleness_metrics(r, lags))
    return out


def _replica_sums(parts: Parts, src: float, rewards: Sequence[float], failures: int, rollouts: Sequence[Rollout],
                  learned: Sequence[Rollout]) -> None:
    """rewards: this replica's, one per row; rollouts: its batches of the step; learned: the
    rollout batches the learner ran, every epoch (counted on the replica source only)."""
    parts.sums.update({
        "rows": src * len(rewards),
        "reward": src * sum(rewards),
        "correct": src * sum(r >= 1.0 for r in rewards),
        "failures": src * failures,
        "completion_tokens": src * sum(ro.num_completion_tokens() for ro in rollouts),
        "stopped": src * sum(f != "length" for ro in rollouts for f in ro.finish_reasons),
        # sequence positions (prompt + completion) the learner ran through replay and dense
        "learner_positions": src * sum(ro.batch_size * ro.schedule.num_steps for ro in learned),
    })


def _env_sums(parts: Parts, src: float, rollouts: Sequence[Rollout]) -> None:
    episodes = [e for ro in rollouts for e in ro.episodes]
    for key in ("turns", "tool_calls", "tool_errors", "observation_tokens", "truncated", "departures",
                "blocking_waits", "faults"):
        parts.sums[f"env_{key}"] = src * sum(getattr(e, key) for e in episodes)
    parts.high("env_observation_tokens_max", max((e.observation_tokens for e in episodes), default=0))


def _learner_sums(parts: Parts, records: Sequence[dict], first_records: int, with_correction: bool) -> None:
    """The objective's records on a loss rank (empty elsewhere), the first ``first_records`` of
    them the first minibatch's (epoch 0, minibatch 0)."""
    s = parts.sums
    s.update(dict.fromkeys(LEARNER_SUMS, 0.0))
    for key in ("ratio_min", "first_ratio_min", "rho_min"):
        parts.low(key, INF)
    for key in ("ratio_max", "first_ratio_max", "diff_max", "rho_max"):
        parts.high(key, -INF)
    for i, m in enumerate(records):
        n = m["num_tokens"]
        for key in ("ratio_sum", "clipped", "support_miss", "kl_sum"):
            s[key] += m[key]
        s["tokens"] += n
        s["entropy_sum"] += m.get("entropy_sum", 0.0)
        s["diff_sum"] += m["logprob_diff_mean"] * n
        s["miss_dense_sum"] += m["support_miss_dense"] * n
        parts.high("diff_max", m["logprob_diff_max"])
        if n:
            parts.low("ratio_min", m["ratio_min"])
            parts.high("ratio_max", m["ratio_max"])
        if with_correction and "rho_sum" in m:  # (a batch that kept no row carries no proximal: no tokens)
            for key in ("rho_sum", "is_weight_sum", "is_rejected"):
                s[key] += m[key]
            if n:
                parts.low("rho_min", m["rho_min"])
                parts.high("rho_max", m["rho_max"])
        if i < first_records:
            s["first_tokens"] += n
            # KL(mu || dense) on the first minibatch only: later ones were sampled before an
            # update, so theirs would mix the policy's own drift into the schedule mismatch.
            s["first_kl_sum"] += m["kl_mu_dense"] * n
            if n:
                parts.low("first_ratio_min", m["ratio_min"])
                parts.high("first_ratio_max", m["ratio_max"])


def _version_sums(parts: Parts, records: Sequence[dict], lags: dict[int, int]) -> None:
    for v in lags:
        parts.sums[f"v{v}_n"], parts.sums[f"v{v}_ratio_sum"] = 0.0, 0.0
        parts.low(f"v{v}_ratio_min", INF)
        parts.high(f"v{v}_ratio_max", -INF)
        for m in records:
            if v in m.get("by_version", {}):
                x = m["by_version"][v]
                parts.sums[f"v{v}_n"] += x["n"]
                parts.sums[f"v{v}_ratio_sum"] += x["sum"]
                parts.low(f"v{v}_ratio_min", x["min"])
                parts.high(f"v{v}_ratio_max", x["max"])


def _scalars(r: dict[str, float]) -> dict[str, float]:
    rows, tokens = max(r["rows"], 1.0), max(r["tokens"], 1.0)
    return {
        "reward/mean": r["reward"] / rows,
        "reward/accuracy": r["correct"] / rows,
        "reward/failures": r["failures"],
        "completion/length_mean": r["completion_tokens"] / rows,
        "completion/stopped_fraction": r["stopped"] / rows,
        "ratio/min": r["ratio_min"] if r["ratio_min"] != INF else 1.0,
        "ratio/mean": r["ratio_sum"] / tokens,
        "ratio/max": r["ratio_max"] if r["ratio_max"] != -INF else 1.0,
        "ratio/clip_fraction": r["clipped"] / tokens,
        "support/miss_fraction": r["support_miss"] / tokens,
        "mismatch/logprob_diff_max": max(r["diff_max"], 0.0),
        "mismatch/logprob_diff_mean": r["diff_sum"] / tokens,
        "mismatch/kl_mu_dense": r["first_kl_sum"] / max(r["first_tokens"], 1.0),
        "mismatch/support_miss_dense": r["miss_dense_sum"] / tokens,
        # every replica's completions per second of the (slowest rank's) generate phase
        "perf/rollout_tokens_per_s": r["completion_tokens"] / max(r["t_generate"], 1e-9),
        "perf/learner_tokens_per_s": r["learner_positions"] / max(r["t_learn"], 1e-9),
        "policy/entropy": r["entropy_sum"] / tokens,  # the dense policy's, under the rollout's processing
    }


def _onpolicy_scalars(r: dict[str, float], learned: "Learned", lag: int, with_correction: bool) -> dict[str, float]:
    """``ratio/policy_change_max_dev``: max |pi / mu - 1| with pi the step's starting policy, how
    far the policy moved since the samples were drawn (0 at lag 0): the first minibatch's ratios
    (against mu), or under grpo.is_correction rho = pi_old / mu (the ratios are against pi_old
    there); logged when measured (a replay, or mu checked against one: unchecked, the ratios are
    mu - mu = 0 by construction). ``ratio/onpolicy_max_dev``: max |ratio - 1| against the policy
    version that sampled the first minibatch, exactly 0 by the exactness contract: what
    grpo.verify_onpolicy's replay under that version measured (it stops the run otherwise), or
    at lag 0 the first minibatch's own replay."""
    def dev(low: float, high: float) -> float:
        return max(abs((high if high != -INF else 1.0) - 1.0), abs((low if low != INF else 1.0) - 1.0))

    first = dev(r["first_ratio_min"], r["first_ratio_max"])
    out = {}
    if with_correction:
        out["ratio/policy_change_max_dev"] = dev(r["rho_min"], r["rho_max"])
    elif learned.first_replayed:
        out["ratio/policy_change_max_dev"] = first
    if learned.onpolicy_checked:
        out["ratio/onpolicy_max_dev"] = 0.0
    elif lag == 0 and learned.first_replayed:
        out["ratio/onpolicy_max_dev"] = first
    return out


def _env_scalars(r: dict[str, float]) -> dict[str, float]:
    """Per sampled row, tool errors per tool call; the max over every row of the step."""
    rows = max(r["rows"], 1.0)
    return {"env/turns": r["env_turns"] / rows, "env/tool_calls": r["env_tool_calls"] / rows,
            "env/tool_errors": r["env_tool_errors"] / max(r["env_tool_calls"], 1.0),
            "env/observation_tokens": r["env_observation_tokens"] / rows,
            "env/observation_tokens_max": r["env_observation_tokens_max"],
            "env/truncated": r["env_truncated"] / rows,
            # calls per completion that ran while the row was out of the batch (its slot given to
            # another row), and that the rollout waited for at once, no other row able to run
            "env/departures": r["env_departures"] / rows,
            "env/blocking_waits": r["env_blocking_waits"] / rows,
            "env/faults": r["env_faults"]}  # the environment's code failing (rollout/env/base.py)


def _correction_scalars(r: dict[str, float]) -> dict[str, float]:
    """rho = pi_old / mu, the policy change since the samples were drawn."""
    tokens = max(r["tokens"], 1.0)
    return {"is/rho_min": r["rho_min"] if r["rho_min"] != INF else 1.0, "is/rho_mean": r["rho_sum"] / tokens,
            "is/rho_max": r["rho_max"] if r["rho_max"] != -INF else 1.0,
            "is/weight_mean": r["is_weight_sum"] / tokens, "is/rejected_fraction": r["is_rejected"] / tokens}


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
