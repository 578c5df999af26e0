"""The sampler's per-step loop without host synchronisation: reads of device values (``.item()``,
``bool()``, ``.tolist()``, ops whose output shape depends on values) happen only at the checks
every ``check_every`` steps and at set-up and the end, never per step; and checking less often
changes no completion, no finish reason and no mu (stop strings found late are trimmed), while the
replay stays torch.equal to mu."""

import pytest
import torch

from rlt_mega.schedule.rows import LOCKSTEP, RowSwitches
from torch.utils._python_dispatch import TorchDispatchMode

from rlt_mega.config import ModelConfig
from rlt_mega.model.rlt import build_model
from rlt_mega.rollout import Processing, Sampler, SamplingParams, generate, replay
from rlt_mega.schedule.rows import LOCKSTEP, RowSwitches

PROMPTS = [[1, 2, 3], [6, 7, 8, 9, 10], [3, 5, 7, 9, 11, 13], [4, 4]]
aten = torch.ops.aten
# Ops that read a device value on the host (on CUDA: a synchronisation).
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten.masked_select.default,
         aten.unique_consecutive.default, aten._unique2.default, aten.repeat_interleave.Tensor}


class HostReads(TorchDispatchMode):
    """Counts the host reads of tensor values under it: the READS ops, indexing with a boolean
    mask (a nonzero inside), and Tensor.tolist (which does not dispatch on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.count += 1
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t):
            counter.count += 1
            return counter._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def tiny(C: int = 2):
    return build_model(ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, memory_block=C, max_seq_len=96,
                                   init_std=0.1), seed=0)


def reads(model, max_new: int, check_every: int, **kw) -> tuple[int, object]:
    sampler = Sampler(model, check_every=check_every)
    params = SamplingParams(Processing(temperature=0.9, top_p=0.9), max_new_tokens=max_new, **kw)
    with torch.no_grad(), HostReads() as counter:
        rollout = sampler.generate([PROMPTS], params, [[1, 2, 3, 4]], pad_id=0)[0]
    return counter.count, rollout


@pytest.mark.parametrize("C", [1, 3])
def test_host_reads_happen_at_checks_only(C):
    model = tiny(C)
    # Without checks, the reads do not depend on the number of steps (set-up and the end only).
    never_short, short = reads(model, 10, check_every=1000)
    never_long, long = reads(model, 40, check_every=1000)
    assert long.schedule.num_steps > short.schedule.num_steps + 25
    assert never_long == never_short <= 8
    # With a check every 8 steps: exactly one more read per check (the finish flags).
    every8, rollout = reads(model, 40, check_every=8)
    steps = rollout.schedule.num_steps
    checks = len([t for t in range(steps - 1) if (t + 1) % 8 == 0])
    assert checks >= 4 and every8 == never_long + checks
    # A replay reads no more than that (its flags never stop it).
    with torch.no_grad(), HostReads() as counter:
        Sampler(model, check_every=8).replay([rollout])
    assert counter.count <= every8


def test_stop_strings_are_read_at_checks_only():
    model = tiny()
    decode = lambda ids: "".join("xyz"[i % 3] for i in ids)  # noqa: E731
    sampler = Sampler(model, check_every=8)
    params = SamplingParams(Processing(temperature=0.9), max_new_tokens=40, stop_strings=("zzzz",))
    with torch.no_grad(), HostReads() as counter:
        rollout = sampler.generate([PROMPTS], params, [[1, 2, 3, 4]], pad_id=0, decode=decode)[0]
    checks = len([t for t in range(rollout.schedule.num_steps - 1) if (t + 1) % 8 == 0]) + 1  # + the final one
    assert counter.count <= 8 + 4 * checks  # flags, and at most three reads of the newest tokens per check


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checking_less_often_changes_no_completion(dtype):
    model = tiny()
    decode = lambda ids: "".join(chr(65 + i % 26) for i in ids)  # noqa: E731
    base = generate(model, PROMPTS, SamplingParams(Processing(temperature=1.0), max_new_tokens=14), seeds=[1, 2, 3, 4],
                    pad_id=0, dtype=dtype, check_every=1)
    stop_token = base.completion(0)[4]
    stop_string = decode(base.completion(1)[5:7])
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=14, stop_token_ids=(stop_token,),
                            stop_strings=(stop_string,))
    for rows in (LOCKSTEP, RowSwitches()):  # finished rows fed pad, or leaving at the check
        runs = {k: generate(model, PROMPTS, params, seeds=[1, 2, 3, 4], pad_id=0, dtype=dtype, decode=decode,
                            check_every=k, rows=rows) for k in (1, 3, 8)}
        ref = runs[1]
        assert "stop_token" in ref.finish_reasons and "stop_string" in ref.finish_reasons
        for k, ro in runs.items():
            assert ro.finish_reasons == ref.finish_reasons and ro.completion_lens == ref.completion_lens, k
            assert [ro.completion(b) for b in range(4)] == [ref.completion(b) for b in range(4)], k
            if rows == LOCKSTEP:  # the same batch at every step: the same values
                assert torch.equal(ro.mu, ref.mu), k
            else:  # rows leave at other steps: other GEMM shapes, other rounding
                assert (ro.mu - ref.mu).abs().max() <= (1e-5 if dtype == "fp32" else 0.05), k
            for b in range(4):  # after a completion: pad, also where a stop string was found late
                end = ro.schedule.prompt_lens[b] + ro.completion_lens[b]
                assert (ro.tokens[b, end:] == 0).all(), (k, b)
            assert torch.equal(replay(model, ro), ro.mu), k
        assert runs[8].schedule.rows.num_steps >= ref.schedule.rows.num_steps  # up to check_every - 1 steps more


@pytest.mark.parametrize("bad,position", [(48, 2), (-1, 0), (10**6, 1)])
def test_prompt_ids_outside_the_vocabulary_are_named_before_sampling(bad, position):
    """A prompt id the embedding has no row for (a tokenizer larger than model.vocab_size, a
    negative id): one line naming the batch, the row, the id and its position, before any step
    (not an IndexError from inside the decoder)."""
    prompt = [5, 6, 7]
    prompt[position] = bad
    sampler = Sampler(tiny(), check_every=4)
    with pytest.raises(ValueError) as err:
        sampler.generate([PROMPTS, PROMPTS[:2] + [prompt]], SamplingParams(max_new_tokens=4),
                         [[1, 2, 3, 4], [5, 6, 7]], pad_id=0)
    assert str(err.value) == (
        f"prompt row 2 of batch 1 holds token id {bad} (position {position}), outside the model's vocabulary "
        "[0, 48) (model.vocab_size=48): the tokenizer and the model disagree (check data.tokenizer and "
        "model.vocab_size)")
    with pytest.raises(ValueError, match=r"^pad id 48 is outside the model's vocabulary \[0, 48\)"):
        sampler.generate([PROMPTS], SamplingParams(max_new_tokens=4), [[1, 2, 3, 4]], pad_id=48)
