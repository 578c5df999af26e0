"""GRPO under TP/PP/ZeRO, run on every rank by tests/distributed/worker.py (``grpo_scenarios.<fn>``).

- ``replay_exact``: the sampler ring on this layout; its replay is torch.equal to mu, and the
  rollout agrees with one process sampling the same batches with the same seeds.
- ``grpo_step_vs_reference``: one GRPO step of the real trainer (every phase, two minibatches:
  the second is off-policy after the first update) against a single-process GRPO step written
  from the library's one-device pieces: every data-parallel rank's prompts and seeds sampled by
  ``generate`` on the full model, the combined minibatch's loss over the global token count,
  torch clipping and AdamW. The trainer's learner follows the data (compaction and shared
  prompts), the reference runs the padded dense schedule.

Scenarios return numbers; the tests assert.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from rlt_mega.config import Config, from_dict
from rlt_mega.data.datasets import RecordOrder
from rlt_mega.data.pairs import prompt_ids
from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.learner.aggregation import loss_count
from rlt_mega.learner.grpo import group_advantages, grpo_loss
from rlt_mega.learner.logprob import dense_logprobs, hybrid_logprobs
import rlt_mega.loss as loss_module
from rlt_mega.loss import DENSE_ROWS
from rlt_mega.schedule.dense import DensePlan
from rlt_mega.schedule.prompt_pack import PromptPack
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import param_groups
from rlt_mega.parallel.gather import gather_full
from rlt_mega.parallel.sharding import shard_for_rank
from rlt_mega.rollout import Comms, Processing, Sampler, SamplingParams, generate, replay
from rlt_mega.rollout.env import EnvLimits, Environment, Environments, Turn
from rlt_mega.rollout.rewards import score
from rlt_mega.model.decoder import StepRunner
from rlt_mega.schedule.rows import LOCKSTEP, Leave, RowSwitches
from rlt_mega.train.common import max_new_tokens_for, sampling_params
from rlt_mega.train.grpo import (batches_per_minibatch, build_trainer, engine_config, environments, grpo_config,
                                 loss_settings, request_seeds)
from tests.distributed.scenarios import max_diff

MODEL = dict(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, memory_block=2,
             max_seq_len=48, init_std=0.1)
RAGGED = [[[1, 2, 3], [6, 7, 8, 9, 10], [3, 5, 7, 9, 11, 13]], [[4, 4], [8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8]]]


def _bf16(model, dtype: str):
    return model.to(torch.bfloat16) if dtype == "bf16" else model


# Groups of G = 4 and 1 (the row schedule forks the first two prompts)
GROUPED = [[[1, 2, 3]] * 4 + [[6, 7, 8, 9, 10]] + [[3, 5, 7, 9, 11, 13]] * 4,
           [[8, 9, 10, 11, 12, 13, 14]] * 4 + [[4, 4]] * 4]


class Letters(Environment):
    """Triggered often by a random model (letters decoded from ids mod 26); answers 1-4 tokens, so
    insertions start and end at every offset of a memory block; ends the episode on a 'z'."""

    triggers = tuple("aeiou")

    def step(self, state, text):
        if "z" in text:
            return Turn(done=True)
        return Turn(observation="x" * (1 + sum(map(ord, text)) % 4), tool_call=True)


def letters(ids) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def letter_ids(text) -> list[int]:
    return [ord(c) - 97 + 26 for c in text]


def _episodes(batches):
    return [Environments(Letters(), letter_ids, EnvLimits(max_turns=4)).episodes([{}] * len(b)) for b in batches]


def _moved(model):
    """Policy version 1 of a model (version 0): every parameter moved by a seeded random step."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _loader(model, versions: dict):
    def load(v: int) -> None:
        with torch.no_grad():
            for p, x in zip(model.parameters(), versions[v]):
                p.copy_(x)
    return load


def replay_exact(parallel: dict, dtype: str = "fp32", model: dict | None = None, rows: dict | None = None,
                 env: bool = False, switch: bool = False) -> dict:
    """Two ragged batches in flight (temperature 0.7, top-p 0.9, a stop token); bf16 as DeepSpeed
    runs it (bf16 parameters). rows: the plan's options (schedule/rows.py), with grouped prompts;
    None: the lockstep plan on ragged prompts. ``steps``: the model's decoder step's calls during
    the rollout and the replays (the step that ran, not only its values). env: an environment's
    observations inserted (a check every step, rollout/turns.py). switch: partial rollouts, the
    calls start under version 0 and switch to version 1 (``_moved``) before decode step 8 rounded
    up to a memory block; the replay repeats the switch."""
    cfg = from_dict({"model": {**MODEL, **(model or {})}, "data": {"seq_len": 32}, "parallel": parallel})
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu")
    full = _bf16(build_model(cfg.model, "cpu", seed=7), dtype)
    mine = _bf16(shard_for_rank(build_model(cfg.model, "cpu", seed=7), dims), dtype)
    versioned = {}
    if switch:  # (the parameters of versions 0 and 1, this rank's and the whole model's, and a switch step)
        C = cfg.model.memory_block
        moved = _moved(build_model(cfg.model, "cpu", seed=7))
        mine_1 = _bf16(shard_for_rank(moved, dims), dtype)
        full_1 = _bf16(_moved(build_model(cfg.model, "cpu", seed=7)), dtype)
        versioned = {"version": 0, "switch": (C * -(-8 // C), 1)}
        load = _loader(mine, {0: [p.detach().clone() for p in mine.parameters()], 1: list(mine_1.parameters())})
        load_full = _loader(full, {0: [p.detach().clone() for p in full.parameters()], 1: list(full_1.parameters())})
    switches = LOCKSTEP if rows is None else RowSwitches(**rows)
    every = 1 if env else 2 if rows else 8
    sampler = Sampler(mine, Comms.from_dims(dims), dims.layers, rows=switches, check_every=every)
    params = SamplingParams(Processing(temperature=0.7, top_p=0.9), max_new_tokens=14 if env else 9,
                            stop_token_ids=(0,))
    batches = RAGGED if rows is None else GROUPED
    seeds = [[11 + 10 * j + b for b in range(len(batch))] for j, batch in enumerate(batches)]
    steps = {"rollout": 0, "replay": 0}
    phase = ["rollout"]
    original = StepRunner.step

    def counted(self, *args):
        steps[phase[0]] += 1
        return original(self, *args)

    StepRunner.step = counted
    try:
        rollouts = sampler.generate(batches, params, seeds, pad_id=0, dtype=dtype, decode=letters,
                                    episodes=_episodes(batches) if env else None,
                                    **({**versioned, "load": load} if switch else {}))
        phase[0] = "replay"
        replays, again = (sampler.replay(rollouts, load=load if switch else None) for _ in range(2))
    finally:
        StepRunner.step = original
    out = {"has_values": replays[0] is not None, "exact": True, "exact_again": True, "tokens_equal_one_process": True,
           "mu_diff_one_process": 0.0, "calls_equal_one_process": True, "num_tokens": 0, "steps": steps,
           "decoder": sorted({ro.schedule.decoder for ro in rollouts})}
    out["events"] = sorted({type(e).__name__ for ro in rollouts for e in ro.schedule.rows.log})
    out["leaves"] = sorted({e.why for ro in rollouts for e in ro.schedule.rows.log if isinstance(e, Leave)})
    for ro, rp, rp2, batch, s in zip(rollouts, replays, again, batches, seeds):
        if switch:
            ref = Sampler(full, rows=switches, check_every=every).generate(
                [batch], params, [s], pad_id=0, dtype=dtype, decode=letters, **versioned, load=load_full)[0]
        else:
            ref = generate(full, batch, params, s, pad_id=0, dtype=dtype, rows=switches, check_every=every,
                           decode=letters, episodes=_episodes([batch])[0] if env else None)
        out["num_tokens"] += ro.num_completion_tokens()
        if rp is not None:
            out["exact"] &= bool(torch.equal(rp, ro.mu))
            out["exact_again"] &= bool(torch.equal(rp2, ro.mu))
        same = ro.tokens.shape == ref.tokens.shape and bool(torch.equal(ro.tokens, ref.tokens))
        out["tokens_equal_one_process"] &= same
        out["calls_equal_one_process"] &= ro.schedule.encoder_calls == ref.schedule.encoder_calls
        if same:
            out["mu_diff_one_process"] = max(out["mu_diff_one_process"], float((ro.mu - ref.mu).abs().max()))
    dims.destroy()
    return out


# ------------------------------------------------------------------------------------------
# One GRPO step against one process
# ------------------------------------------------------------------------------------------

def odd(completion: str, answer) -> float:
    """A reward that differs between completions from the first step: the fraction of
    characters with an odd code point."""
    return sum(ord(c) % 2 for c in completion) / max(len(completion), 1)


class EveryThird(Environment):
    """A tool called after every third character of the model's turn, answering '12' (GRPO
    scenarios with an environment: grpo.env=tests.distributed.grpo_scenarios:EveryThird)."""

    def triggered(self, text):
        return len(text) >= 3

    def step(self, state, text):
        return Turn(observation="12", tool_call=True)


def grpo_cfg(parallel: dict, train: dict | None = None, grpo: dict | None = None,
             sampling: dict | None = None) -> Config:
    return from_dict({
        "model": MODEL,
        "data": {"tokenizer": "byte", "seq_len": 32},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.1, "grad_clip": 0.5},
        "train": {"seed": 3, "steps": 1, "checkpointing": {"decoder": "none", "encoder": False}, **(train or {})},
        "parallel": parallel,
        "sampling": {"temperature": 1.0, "max_new_tokens": 6, **(sampling or {})},
        # verify_onpolicy: the skipped first-minibatch replay is run all the same and must be torch.equal to mu
        "grpo": {"prompts_per_step": 2, "group_size": 4, "minibatches": 2, "eval_size": 0, "eps_high": 0.28,
                 "verify_onpolicy": True, **(grpo or {})},
        "logging": {"progress": False},
    })


def records(n: int = 16) -> list[dict]:
    return [{"question": "q" * (i % 4) + str(i), "answer": f"#### {i}"} for i in range(n)]


class OneProcessGRPO:
    """The single-process GRPO step on the combined batch of ``dp`` replicas."""

    def __init__(self, cfg: Config, dp: int) -> None:
        self.cfg, self.dp = cfg, dp
        self.tok = load_tokenizer("byte")
        self.model = build_model(cfg.model, "cpu", seed=cfg.train.seed)
        self.reference = copy.deepcopy(self.model).requires_grad_(False)
        o = cfg.optim
        self.opt = torch.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                     eps=o.eps, foreach=False)

    def step(self, recs: list[dict], lrs: list[float]) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        settings = loss_settings(cfg)
        params = sampling_params(cfg, self.tok)
        envs = environments(cfg, self.tok)
        if envs is not None:
            params = dataclasses.replace(params, stop_token_ids=envs.stop_ids(params.stop_token_ids))
        order = RecordOrder(len(recs), cfg.train.seed, cfg.data.shuffle)
        global_idx = order.take(g.prompts_per_step * self.dp)
        rows_per_rank = g.prompts_per_step * g.group_size
        micro = batches_per_minibatch(grpo_config(cfg))
        size = rows_per_rank // g.minibatches // micro
        # per replica r: micro-batches of each minibatch, as the distributed trainer forms them
        ranks = []
        for r in range(self.dp):
            rows = [recs[i] for i in global_idx[r::self.dp] for _ in range(g.group_size)]
            prompts = [prompt_ids(self.tok, x["question"]) for x in rows]
            seeds = request_seeds(cfg.train.seed, 0, r, len(rows), dp=self.dp, group_size=g.group_size)
            batches = [(prompts[a:a + size], seeds[a:a + size], rows[a:a + size]) for a in range(0, len(rows), size)]
            rollouts = [generate(self.model, p, max_new_tokens_for(self.model, p, params), s, pad_id=self.tok.pad_id,
                                 dtype=cfg.train.dtype, decode=self.tok.decode, check_every=cfg.sampling.check_every,
                                 episodes=None if envs is None else envs.episodes(x)) for p, s, x in batches]
            texts = [self.tok.decode(ro.completion(b)) for ro in rollouts for b in range(ro.batch_size)]
            rewards, _, _ = score(texts, [x["answer"] for x in rows], list(range(len(rows))), odd)
            adv = group_advantages(torch.tensor(rewards), g.group_size, g.advantage, g.advantage_eps)
            refs = [replay(self.reference, ro) for ro in rollouts] if g.kl_coef > 0 else [None] * len(rollouts)
            ranks.append((rollouts, adv.split(size), refs, rewards))
        out = {"rollouts": [r[0] for r in ranks], "rewards": [x for r in ranks for x in r[3]], "loss": [], "norm": []}
        per_mb = len(ranks[0][0]) // g.minibatches
        for k in range(g.minibatches):
            picked = [(ro, a, ref) for rollouts, adv, refs, _ in ranks
                      for ro, a, ref in list(zip(rollouts, adv, refs))[k * per_mb:(k + 1) * per_mb]]
            # The step's normaliser over every replica's batches (grpo.loss_agg).
            count = sum(loss_count(ro.mask.bool(), g.loss_agg, settings.loss_agg_length) for ro, _, _ in picked)
            self.opt.zero_grad(set_to_none=True)
            total = 0.0
            for ro, a, ref in picked:
                logp = hybrid_logprobs(dense_logprobs(self.model, ro), replay(self.model, ro))
                loss = grpo_loss(logp, ro.mu, a, ro.mask, g.eps_low, g.eps_high, ref_logp=ref,
                                 kl_coef=g.kl_coef if ref is not None else 0.0, loss_agg=g.loss_agg).loss / count
                loss.backward()
                total += float(loss)
            for grp in self.opt.param_groups:
                grp["lr"] = lrs[k]
            out["norm"].append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)))
            out["loss"].append(total)
            self.opt.step()
        out["params"] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        out["moved"] = max_diff(out["params"], {n: p for n, p in self.reference.named_parameters()})[0]
        return out


@contextlib.contextmanager
def _zero3_persistence(threshold: int | None):
    """DeepSpeed's stage3_param_persistence_threshold while an engine is built (the scenarios of
    a launch share the process: the patch must not outlive its scenario)."""
    if threshold is None:
        yield
        return
    from rlt_mega.parallel import zero

    original = zero.deepspeed_config

    def patched(*args, **kwargs):
        cfg = original(*args, **kwargs)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
        return cfg

    zero.deepspeed_config = patched
    try:
        yield
    finally:
        zero.deepspeed_config = original


@contextlib.contextmanager
def _prompt_packs():
    """The encoder's prompt packs built inside (grpo.dense_share_prompts): (packed positions,
    padded B x T) each."""
    packs, init = [], PromptPack.__init__

    def spy(self, rows, T, device):
        init(self, rows, T, device)
        packs.append((self.total, rows.batch_size * T))

    PromptPack.__init__ = spy
    try:
        yield packs
    finally:
        PromptPack.__init__ = init


def grpo_step_vs_reference(parallel: dict, train: dict | None = None, grpo: dict | None = None,
                           persistence_threshold: int | None = None, sampling: dict | None = None) -> dict:
    """One GRPO step (two minibatches) of the distributed trainer against ``OneProcessGRPO``.
    ``persistence_threshold`` (ZeRO-3): DeepSpeed's stage3_param_persistence_threshold, 0 to
    partition every parameter of the tiny model (else all stay whole and nothing is tested)."""
    cfg = grpo_config(grpo_cfg(parallel, train, grpo, sampling))
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
    recs = records()
    with _zero3_persistence(persistence_threshold):
        trainer = build_trainer(cfg, dims, load_tokenizer("byte"), odd, recs, [])
    captured = {}
    original = trainer.engine.train_step

    def spy(batches, loss):
        stats = original(batches, loss)
        captured.setdefault("stats", []).append(stats)
        captured.setdefault("rollouts", []).extend(p.rollout for b in batches for p in b["parts"])
        for b in batches:  # the decoder's row-steps (compaction, shared prompts) and the padded ones
            rows = b.get(DENSE_ROWS)
            steps = b["inputs"].numel() if rows is None else DensePlan(rows, b["inputs"].shape[1], torch.device("cpu")).active
            captured.setdefault("row_steps", []).append((steps, b["inputs"].numel()))
        return stats

    trainer.engine.train_step = spy
    chunks, checkpoint = [], loss_module.checkpoint  # the chunked head's chunks (train.checkpointing.head_chunk)
    loss_module.checkpoint = lambda *a, **k: chunks.append(1) or checkpoint(*a, **k)
    try:
        with _prompt_packs() as packs:
            scalars = trainer.job.step(0)
    finally:
        loss_module.checkpoint = checkpoint
    stats = captured["stats"]
    ref = OneProcessGRPO(cfg, dims.dp).step(recs, [s.lr for s in stats])
    mine = captured["rollouts"][:len(captured["rollouts"]) // cfg.grpo.epochs]
    theirs = ref["rollouts"][dims.dp_rank]
    same_tokens = len(mine) == len(theirs) and all(
        a.tokens.shape == b.tokens.shape and torch.equal(a.tokens, b.tokens) for a, b in zip(mine, theirs))
    mu_diff = max(float((a.mu - b.mu).abs().max()) for a, b in zip(mine, theirs)) if same_tokens else float("inf")
    full = gather_full(trainer.engine.parameters_fp32(), dims)
    param_diff, worst = max_diff(full, ref["params"])
    out = {"param_moved": ref["moved"], "same_tokens": same_tokens, "mu_diff": mu_diff,
           "loss": [s.loss for s in stats], "ref_loss": ref["loss"],
           "norm": [s.grad_norm for s in stats], "ref_norm": ref["norm"], "param_diff": param_diff,
           "param_worst": worst, "scalars": scalars, "ref_reward_mean": sum(ref["rewards"]) / len(ref["rewards"]),
           "row_steps": [sum(s for s, _ in captured["row_steps"]), sum(p for _, p in captured["row_steps"])],
           "packs": packs, "head_chunks": len(chunks), "last_stage": dims.is_last_stage}
    trainer.engine.close()
    dims.destroy()
    return out


def constant_for_most(completion: str, answer) -> float:
    """Constant (1.0) for two prompts in three, the odd-character fraction for the others."""
    return odd(completion, answer) if int(answer.split()[-1]) % 3 == 0 else 1.0


def dynamic_sampling_step(parallel: dict, grpo: dict | None = None) -> dict:
    """One GRPO step with dynamic sampling under a reward that makes most groups constant:
    every replica learns from prompts_per_step informative groups, on-policy ratios exactly 1."""
    cfg = grpo_config(grpo_cfg(parallel, None, {"dynamic_sampling": True, "max_sampling_rounds": 8, **(grpo or {})}))
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
    trainer = build_trainer(cfg, dims, load_tokenizer("byte"), constant_for_most, records(48), [])
    kept_rows = []
    original = trainer.engine.train_step

    def spy(batches, loss):
        kept_rows.append(sum(int(p.rows.sum()) for b in batches for p in b["parts"]))
        return original(batches, loss)

    trainer.engine.train_step = spy
    scalars = trainer.job.step(0)
    trainer.engine.close()
    dims.destroy()
    return {"scalars": scalars, "kept_rows": kept_rows, "dp": dims.dp}


# ------------------------------------------------------------------------------------------
# grpo.teacher: the teacher's scores on this layout against one process
# ------------------------------------------------------------------------------------------

TEACHER = dict(MODEL, d_model=48, n_layers=3, ffn_hidden=96)  # a larger RLT of the student's vocabulary


def teacher_scores(parallel: dict, teacher_dir: str, train: dict | None = None, grpo: dict | None = None) -> dict:
    """One GRPO step with grpo.teacher (learner/distill.py) on this layout: the teacher (its own
    3 layers split over the stages, its heads over the TP ranks) scores every learned rollout;
    the scores on the loss rank against the whole teacher replaying the same rollouts on one
    process, and with grpo.teacher_topk its top-k (ids, log-probs) likewise. Rank 0 writes the
    teacher's export into ``teacher_dir`` first."""
    import torch.distributed as dist

    from rlt_mega.checkpoint_tools.export import export_model
    from rlt_mega.config import ModelConfig

    cfg = grpo_config(grpo_cfg(parallel, train, {"teacher": teacher_dir, **(grpo or {})}))
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
    teacher_cfg = ModelConfig(**TEACHER)
    whole = build_model(teacher_cfg, "cpu", seed=5)
    if dims.rank == 0:
        export_model(whole, teacher_cfg, teacher_dir, overwrite=True)
    dist.barrier()
    trainer = build_trainer(cfg, dims, load_tokenizer("byte"), odd, records(), [])
    parts = []
    original = trainer.engine.train_step
    trainer.engine.train_step = lambda batches, loss: parts.extend(p for b in batches for p in b["parts"]) or \
        original(batches, loss)
    scalars = trainer.job.step(0)
    scored = [p for p in parts if p.teacher is not None]
    diff = max((float((p.teacher - replay(whole, p.rollout)).abs().max()) for p in scored), default=float("inf"))
    k = cfg.grpo.teacher_topk  # the top-k (grpo.teacher_topk) against the whole teacher's on one process
    topk_diff, topk_ids_equal = 0.0, True
    for p in scored if k else ():
        _, ids, lp = Sampler(whole).replay_topk([p.rollout], k)[0]
        topk_diff = max(topk_diff, float((p.teacher_topk[1] - lp).abs().max()))
        topk_ids_equal &= torch.equal(p.teacher_topk[0], ids)
    out = {"is_loss_rank": dims.is_loss_rank, "num_scored": len(scored), "num_parts": len(parts),
           "teacher_diff_one_process": diff, "topk_diff_one_process": topk_diff, "topk_ids_equal": topk_ids_equal,
           "scalars": scalars,
           "tokens": sum(int(p.loss_mask().sum()) for p in scored)}
    trainer.engine.close()
    dims.destroy()
    return out
