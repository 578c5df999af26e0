"""Bounded staleness (grpo.max_staleness, train/async_grpo.py) on the real trainer, one process:
step k learns from samples whose mu is torch.equal to a replay under the parameters of version
max(0, k - s) (and not under version k), every step's staleness is min(k, s), two runs are the
same run, and a run stopped after a checkpoint and resumed with train.resume=auto ends with the
uninterrupted run's parameters and losses bit for bit (the queue travels in job_rank<r>.pt)."""

import copy
import json

import pytest
import torch

from rlt_mega.config import ConfigError
from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.schedule.rows import RowSwitches
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.rollout import Comms, Sampler
from rlt_mega.train.grpo import build_trainer, grpo_config
from tests.distributed.grpo_scenarios import grpo_cfg, odd, records

LAYOUT = {"prompts_per_step": 2, "group_size": 2, "minibatches": 1, "verify_onpolicy": False}


def trainer_for(grpo: dict, tmp_path=None, train: dict | None = None):
    train = {"steps": 3, **(train or {})}
    if tmp_path is not None:
        train["resume"] = "auto"
    cfg = grpo_cfg({}, train, {**LAYOUT, **grpo})
    if tmp_path is not None:
        cfg.checkpoint.dir, cfg.logging.dir = str(tmp_path / "ckpt"), str(tmp_path / "log")
    cfg = grpo_config(cfg)
    dims = ParallelDims.single(cfg.model, "cpu")
    return build_trainer(cfg, dims, load_tokenizer("byte"), odd, records(24), [])


def params_of(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.sampling_module().named_parameters()}


def sampler_on(trainer, model) -> Sampler:
    cfg, dims = trainer.cfg, trainer.dims
    return Sampler(model, Comms.from_dims(dims), dims.layers, check_every=cfg.sampling.check_every,
                   rows=RowSwitches(slots=cfg.sampling.slots))


@pytest.mark.parametrize("s", [1, 2])
def test_step_k_learns_the_samples_of_version_k_minus_s(s):
    trainer = trainer_for({"max_staleness": s})
    job = trainer.job
    versions = [copy.deepcopy(trainer.engine.sampling_module())]  # versions[v]: the policy after v steps
    learned, pop = [], job.pipeline.pop
    job.pipeline.pop = lambda done: learned.append(pop(done)) or learned[-1]
    lags = []
    for k in range(4):
        lags.append(job.step(k)["async/staleness_max"])
        versions.append(copy.deepcopy(trainer.engine.sampling_module()))
        assert len(job.pipeline.queue) == s  # data steps k+1 .. k+s wait
    assert lags == [min(k, s) for k in range(4)]
    for k, item in enumerate(learned):
        assert item.step == k and item.version == max(0, k - s)
        for rnd in item.rounds:
            for ro, rep in zip(rnd.flat, sampler_on(trainer, versions[item.version]).replay(rnd.flat)):
                assert torch.equal(rep, ro.mu)  # drawn by version k - s, exactly
            if item.version != k:  # the policy moved since: the learner's replay differs from mu
                reps = sampler_on(trainer, versions[k]).replay(rnd.flat)
                assert any(not torch.equal(rep, ro.mu) for ro, rep in zip(rnd.flat, reps))


def test_staleness_zero_learns_onpolicy_and_two_stale_runs_are_the_same_run():
    sync = trainer_for({"max_staleness": 0, "verify_onpolicy": True})  # fails if a first replay is not mu
    for k in range(3):
        scalars = sync.job.step(k)
        assert scalars["async/staleness_max"] == 0.0 and scalars["ratio/onpolicy_max_dev"] == 0.0
    assert len(sync.job.pipeline.queue) == 0
    runs = []
    for _ in range(2):
        t = trainer_for({"max_staleness": 1})
        losses = [t.job.step(k)["train/loss"] for k in range(3)]
        runs.append((params_of(t), losses))
    assert runs[0][1] == runs[1][1]
    assert all(torch.equal(runs[0][0][n], runs[1][0][n]) for n in runs[0][0])
    assert any(not torch.equal(runs[0][0][n], p) for n, p in params_of(sync).items())  # staleness changed it


def test_resume_continues_a_stale_run_bit_for_bit(tmp_path):
    whole = trainer_for({"max_staleness": 2}, tmp_path / "whole", {"log_every": 1})
    whole.run()
    cut = trainer_for({"max_staleness": 2}, tmp_path / "cut", {"stop_after": 2, "log_every": 1})
    cut.run()  # a checkpoint after step 2 queues data steps 2 and 3, drawn by versions 0 and 1
    resumed = trainer_for({"max_staleness": 2}, tmp_path / "cut", {"log_every": 1})
    assert resumed.run()["step"] == 3
    a, b = params_of(whole), params_of(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)

    def losses(run):
        lines = (tmp_path / run / "log" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["train/loss"] for x in lines if "train/loss" in x]

    assert losses("whole") == losses("cut") and len(losses("whole")) == 3


def test_a_queue_resumes_only_under_its_staleness(tmp_path):
    trainer_for({"max_staleness": 1}, tmp_path, {"stop_after": 1}).run()
    with pytest.raises(ConfigError, match=r"grpo\.max_staleness=1, .*this run has max_staleness=2"):
        trainer_for({"max_staleness": 2}, tmp_path).run()


# ---------------------------------------------------------------------- partial rollouts
PARTIAL = {"max_staleness": 1, "partial_rollouts": 5}  # C = 2: the rollouts switch before decode step 6


def loader_of(trainer, versions: dict):
    """load(v): the sampling module's parameters become those of ``versions[v]`` (a module)."""
    params = list(trainer.engine.sampling_module().parameters())

    def load(v: int) -> None:
        with torch.no_grad():
            for p, x in zip(params, versions[v].parameters()):
                p.copy_(x)
    return load


def test_partial_rollouts_record_each_tokens_version_and_replay_exactly():
    """s = 1 with partial rollouts: data step j starts under version max(0, j - 2) and switches
    to max(0, j - 1); each token's mu is its version's (a replay under the start version alone
    on the tokens before the switch, the two-version replay on all of them, bit for bit); the
    learner's replay is a fresh replay of the recorded schedule under its parameters; the
    staleness metrics count each token's own lag."""
    trainer = trainer_for(PARTIAL)
    job = trainer.job
    versions = {0: copy.deepcopy(trainer.engine.sampling_module())}
    learned, pop = [], job.pipeline.pop
    job.pipeline.pop = lambda done: learned.append(pop(done)) or learned[-1]
    replays, minibatch = [], job.phases._minibatch
    job.phases._minibatch = lambda scored, k, reps, prox: replays.append(reps) or minibatch(scored, k, reps, prox)
    scalars = []
    for k in range(4):
        scalars.append(job.step(k))
        versions[k + 1] = copy.deepcopy(trainer.engine.sampling_module())
    load = loader_of(trainer, versions)
    for k, item in enumerate(learned):
        start, target = max(0, k - 2), max(0, k - 1)
        assert item.version == start
        rollouts = [ro for rnd in item.rounds for ro in rnd.flat]
        mask = torch.cat([ro.mask.bool().flatten() for ro in rollouts])
        tokens = torch.cat([ro.version.flatten() for ro in rollouts])[mask]
        assert set(tokens.tolist()) == ({start, target} if k >= 2 else {0})
        lags = (k - tokens).double()
        assert scalars[k]["async/staleness_max"] == lags.max() and scalars[k]["async/staleness_mean"] == lags.mean()
        for lag in set(lags.tolist()):
            assert f"async/lag{lag:.0f}/ratio_mean" in scalars[k]
        sampler = sampler_on(trainer, trainer.engine.sampling_module())
        for rnd in item.rounds:
            for ro, rep in zip(rnd.flat, sampler.replay(rnd.flat, load=load)):
                assert torch.equal(rep, ro.mu)  # the switch repeated: every token's mu, exactly
            load(start)
            for ro, rep in zip(rnd.flat, sampler.replay(rnd.flat)):
                old = ro.mask.bool() & (ro.version == start)
                assert torch.equal(rep[old], ro.mu[old])
            # the learner's replay (under version k) is a fresh replay of the record under version k
            load(k)
            assert all(torch.equal(a, b) for a, b in zip(replays[k][0], sampler.replay(rnd.flat)))


def test_partial_rollouts_are_one_run_and_resume_bit_for_bit(tmp_path):
    """A run, and another stopped after step 2 and resumed, end with the same parameters and
    losses bit for bit."""
    whole = trainer_for(PARTIAL, tmp_path / "a", {"log_every": 1})
    whole.run()
    a = params_of(whole)
    cut = trainer_for(PARTIAL, tmp_path / "cut", {"stop_after": 2, "log_every": 1})
    cut.run()  # the checkpoint holds data step 2 (versions 0 -> 1) and version 1's parameters
    resumed = trainer_for(PARTIAL, tmp_path / "cut", {"log_every": 1})
    assert resumed.run()["step"] == 3
    b = params_of(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in b)

    def logged(run):
        lines = (tmp_path / run / "log" / "metrics.jsonl").read_text().splitlines()
        return [(x["train/loss"], x["async/staleness_mean"]) for x in map(json.loads, lines) if "train/loss" in x]

    assert logged("a") == logged("cut") and len(logged("a")) == 3
    plain = trainer_for({"max_staleness": 1, "partial_rollouts": 0}, tmp_path / "plain", {"stop_after": 1})
    plain.run()
    with pytest.raises(ConfigError, match=r"partial_rollouts=0 on .*this run has max_staleness=1, partial_rollouts=5"):
        trainer_for(PARTIAL, tmp_path / "plain").run()


# ---------------------------------------------------------------------- the on-policy check at stale steps
@pytest.mark.parametrize("grpo", [{"max_staleness": 1}, PARTIAL], ids=["stale", "partial"])
def test_a_stale_step_checks_mu_against_the_version_that_sampled_it(grpo):
    """grpo.verify_onpolicy at max_staleness 1: each step replays its first minibatch under the
    version(s) that sampled it (kept by the learner; two under partial rollouts, the replay
    switching as the sampler did): ``ratio/onpolicy_max_dev`` is that replay's, 0, and
    ``ratio/policy_change_max_dev`` is against the current policy, the policy's move since. A
    queued sample whose mu is one ulp off stops the run at the step that learns it."""
    trainer = trainer_for({**grpo, "verify_onpolicy": True})
    job = trainer.job
    scalars = [job.step(k) for k in range(3)]
    assert [s["ratio/onpolicy_max_dev"] for s in scalars] == [0.0, 0.0, 0.0]
    assert scalars[0]["ratio/policy_change_max_dev"] == 0.0  # lag 0: the current policy sampled it
    assert all(s["ratio/policy_change_max_dev"] > 0.0 for s in scalars[1:])  # lag 1: it moved since
    ro = job.pipeline.queue[0].rounds[0].rollouts[0][0]  # data step 3, learned next
    at = tuple(ro.mask.bool().nonzero()[0])
    ro.mu[at] = torch.nextafter(ro.mu[at], torch.tensor(0.0, dtype=ro.mu.dtype))
    with pytest.raises(RuntimeError, match=r"GRPO step 3: grpo\.verify_onpolicy: .* version that sampled it "
                                           r"\(\d\) is not torch\.equal to mu, max \|replay - mu\| = [1-9]"):
        job.step(3)


def test_the_check_keeps_its_versions_across_a_resume(tmp_path):
    """The versions the check replays under travel in the checkpoint (job_rank<r>.pt): a run
    resumed at step 2 checks step 2's samples (drawn by version 1) as the uninterrupted run does."""
    grpo = {"max_staleness": 1, "verify_onpolicy": True}
    trainer_for(grpo, tmp_path, {"stop_after": 2, "log_every": 1}).run()
    trainer_for(grpo, tmp_path, {"log_every": 1}).run()
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    checked = [x["step"] for x in lines if x.get("ratio/onpolicy_max_dev") == 0.0]
    assert checked == [1, 2, 3]


# ---------------------------------------------------------------------- a pool of samplers
class _Fixed:
    """The parameters as they are (every version the same): a holder for sampling alone."""

    def load(self, version: int) -> None:
        pass

    def restore(self) -> None:
        pass


def test_dynamic_sampling_data_does_not_depend_on_which_sampler_ran_it():
    """Each data step reserves max_sampling_rounds rounds of prompts: with two samplers (one
    samples data steps 0 and 2 and skips 1, the other samples 1 and skips 0) every data step's
    samples, rounds and data order equal those of one sampler sampling every step."""
    grpo = {"dynamic_sampling": True, "max_sampling_rounds": 3}

    def sampled(steps: list[int], upto: int = 3) -> dict:
        job = trainer_for(grpo).job
        out = {}
        for j in range(upto):
            if j in steps:
                out[j], = job.sampling.sample(job.policy.sampler(), j, _Fixed())
            else:
                job.sampling.skip(j)
        return out

    one, first, second = sampled([0, 1, 2]), sampled([0, 2]), sampled([1])
    assert {**first, **second}.keys() == one.keys()
    assert any(one[j].sampling["sampling/rounds"] < 3 for j in one)  # some step left reserved prompts unused
    for j, item in {**first, **second}.items():
        assert item.sampling == one[j].sampling and item.order == one[j].order
        for rnd, ref in zip(item.rounds, one[j].rounds, strict=True):
            assert [r["question"] for r in rnd.rows] == [r["question"] for r in ref.rows]
            assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.mu, b.mu) for a, b in zip(rnd.flat, ref.flat))
