"""Exports that the ecosystem loads (issue 14): a tiny trained export through transformers'
AutoModelForCausalLM(trust_remote_code=True) in a process where rlt_mega cannot be imported,
and through lm-evaluation-harness's own HF model class, compared with rlt_mega's dense
forward (logits, log-probs) and with `rlt-mega generate` (greedy tokens), for C = 1 and 4."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlt_mega import cli
from rlt_mega.checkpoint_tools import export_state_dict, load_exported
from rlt_mega.data.pairs import prompt_ids
from rlt_mega.data.tokenizer import byte_level
from rlt_mega.model.rlt import RLT
from rlt_mega.rollout import Processing, Sampler, SamplingParams

pytest.importorskip("transformers")

MODEL = ["model.vocab_size=260", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=64", "model.memory_block=4", "model.max_seq_len=96", "model.qkv_bias=true"]
TRAIN = ["data.seq_len=48", "data.generated.num_train=400", "data.generated.num_eval=8", "train.micro_batch_size=8",
         "train.eval_every=0", "train.log_every=10", "train.device=cpu", "logging.progress=false",
         "optim.warmup_steps=5", "optim.lr=1e-2", "train.steps=40", "checkpoint.every=0"]
# Prompt lengths (end-of-text + the question + newline, byte tokens) of 19, 27 and 17: none a multiple of 4.
QUESTIONS = ["What is 3 plus 4?", "Tom has 5 pens. How many?", "What is 12 - 7?"]
MAX_NEW = 16
WORKER = Path(__file__).parent / "hf_export_worker.py"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny model pretrained for 40 steps with C = 4, exported by `rlt-mega export`; the same
    weights exported again with C = 1. -> (tmp dir, {C: export dir})."""
    tmp = tmp_path_factory.mktemp("hf")
    run = [*MODEL, *TRAIN, f"checkpoint.dir={tmp / 'ckpt'}", f"logging.dir={tmp / 'tb'}"]
    assert cli.main(["pretrain", *run]) == 0
    assert cli.main(["export", str(tmp / "ckpt"), str(tmp / "export_c4")]) == 0
    cfg, sd = load_exported(tmp / "export_c4")
    export_state_dict(sd, dataclasses.replace(cfg, memory_block=1), tmp / "export_c1", tokenizer="byte")
    return tmp, {4: tmp / "export_c4", 1: tmp / "export_c1"}


def rlt_model(path) -> RLT:
    cfg, sd = load_exported(path)
    model = RLT(cfg)
    model.load_state_dict(sd, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def hf(exports):
    """What transformers computes from the exports, in a fresh process without rlt_mega."""
    tmp, paths = exports
    tok = byte_level()
    request = {
        "exports": {str(c): str(p) for c, p in paths.items()},
        "tokens": torch.randint(0, 259, (3, 21), generator=torch.Generator().manual_seed(0)).tolist(),
        "prompts": [prompt_ids(tok, q) for q in QUESTIONS],
        "max_new_tokens": MAX_NEW,
        "texts": QUESTIONS + ["Ünïcödé ✓ 日本語\ttabs  and  spaces\n", "<|eos|>#### 42"],
    }
    (tmp / "request.json").write_text(json.dumps(request))
    # HF copies remote code into its modules cache: a private one, and nothing from the network
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "hf_modules"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp / "request.json"), str(tmp / "hf.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return request, torch.load(tmp / "hf.pt", weights_only=True)


def test_worker_ran_without_rlt_mega(hf):
    _, res = hf
    assert res["rlt_mega_blocked"] and not res["rlt_mega_loaded"]
    for c in ("1", "4"):
        assert res[c]["class"] == "RLTForCausalLM" and res[c]["module"].startswith("transformers_modules")


@pytest.mark.parametrize("C", [1, 4])
def test_logits_match_rlt_mega_dense_forward(exports, hf, C):
    request, res = hf
    model = rlt_model(exports[1][C])
    with torch.no_grad():
        ref = model(torch.tensor(request["tokens"]))
    got = res[str(C)]["logits"]
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("C", [1, 4])
def test_greedy_generate_matches_rlt_mega(exports, hf, capsys, C):
    """transformers' generate() with the export's cache = the rollout: the same tokens and the
    same encoder calls (prefill [0, C floor(P/C)), then one call per completed block), and
    the same text as `rlt-mega generate`; without a cache, and left-padded in one batch, too."""
    request, res = hf
    out = res[str(C)]
    tok = byte_level()
    assert out["eos"] == tok.eos_id
    assert [len(p) for p in request["prompts"]] == [19, 27, 17]
    sampler = Sampler(rlt_model(exports[1][C]))
    params = SamplingParams(Processing(temperature=0.0), max_new_tokens=MAX_NEW, stop_token_ids=(tok.eos_id,))
    for i, prompt in enumerate(request["prompts"]):
        ro = sampler.generate([[prompt]], params, [[0]], pad_id=tok.pad_id)[0]
        assert out["greedy"][i] == ro.completion(0), f"prompt {i}"
        assert out["encoder_calls"][i] == [list(c) for c in ro.schedule.encoder_calls], f"prompt {i}"
        assert out["greedy_no_cache"][i] == out["greedy"][i]
        n = len(out["greedy"][i])
        assert out["batched"][i][:n] == out["greedy"][i]  # then padding, once the row has stopped
    assert any(len(c) > 1 for c in out["encoder_calls"])  # blocks were committed while generating

    questions = exports[0] / "questions.txt"
    questions.write_text("\n".join(QUESTIONS) + "\n")
    capsys.readouterr()
    assert cli.main(["generate", "--input", str(questions), *MODEL, f"model.memory_block={C}",
                     f"train.init_from={exports[1][C]}", "sampling.temperature=0", f"sampling.max_new_tokens={MAX_NEW}",
                     "train.device=cpu", "data.seq_len=48"]) == 0
    completions = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    assert completions == out["greedy_text"]


def test_auto_tokenizer_is_rlt_megas_byte_tokenizer(hf):
    request, res = hf
    tok = byte_level()
    for C in ("1", "4"):
        assert res[C]["tok_encode"] == [tok.encode(t) for t in request["texts"]]
        assert res[C]["tok_decode"] == [tok.decode(tok.encode(t)) for t in request["texts"]]
        assert res[C]["tok_decode_all"] == request["texts"]  # exact, special tokens kept
        assert res[C]["tok_special"] == [tok.eos_id, tok.pad_id, tok.bos_id]


# lm-evaluation-harness: contexts end without whitespace (lm-eval moves trailing spaces into the
# continuation); "" makes lm-eval start from the tokenizer's start token.
LOGLIKELIHOOD = [("<|eos|>What is 3 plus 4?\n3 + 4 =", " 7"), ("<|eos|>What is 12 - 7?", "\n12 - 7 = 5\n#### 5"),
                 ("", "What is 1 plus 1?")]


def lm_eval_model(path, batch_size):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(path), trust_remote_code=True, device="cpu", batch_size=batch_size, dtype="float32")


def test_lm_eval_loglikelihood_matches_rlt_mega(exports):
    from lm_eval.api.instance import Instance

    path = exports[1][4]
    lm = lm_eval_model(path, batch_size=2)
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(LOGLIKELIHOOD)])
    model, tok = rlt_model(path), byte_level()
    for (context, continuation), (logprob, is_greedy) in zip(LOGLIKELIHOOD, got):
        ctx = tok.encode(context) if context else [tok.bos_id]
        ids = ctx + tok.encode(continuation)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0], dim=-1)  # (T - 1, V)
        steps = torch.arange(len(ctx) - 1, len(ids) - 1)
        targets = torch.tensor(ids[len(ctx):])
        assert abs(logprob - logp[steps, targets].sum().item()) < 1e-5
        assert is_greedy == bool((logp[steps].argmax(-1) == targets).all())


def test_lm_eval_generate_until_matches_rlt_mega_generate(exports, capsys):
    """Greedy generate_until requests, two per batch (lm-eval pads them on the left), against
    `rlt-mega generate`, cut at the stop sequence as lm-eval cuts its own."""
    from lm_eval.api.instance import Instance

    path = exports[1][4]
    questions = exports[0] / "questions_lm_eval.txt"
    questions.write_text("\n".join(QUESTIONS) + "\n")
    capsys.readouterr()
    assert cli.main(["generate", "--input", str(questions), *MODEL, f"train.init_from={path}", "data.seq_len=48",
                     "sampling.temperature=0", f"sampling.max_new_tokens={MAX_NEW}", "train.device=cpu"]) == 0
    completions = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    until = completions[0][4:6]  # a stop sequence that stops at least the first request early
    assert len(until) == 2
    requests = [Instance("generate_until", {}, ("<|eos|>" + q + "\n", {"until": [until], "max_gen_toks": MAX_NEW,
                                                                       "do_sample": False}), i)
                for i, q in enumerate(QUESTIONS)]
    got = lm_eval_model(path, batch_size=2).generate_until(requests)
    assert got == [c.split(until)[0] for c in completions]


@pytest.mark.parametrize("kind, kwargs", [("llama", dict(heads=4, kv_heads=2, tied=True)),
                                          ("qwen2", dict(heads=4, kv_heads=2, theta=1e6))])
def test_imported_dense_model_through_transformers(tmp_path, kind, kwargs):
    """The external anchor through transformers: a dense Llama/Qwen2 imported as an RLT
    (`rlt-mega import`, C = 3) and loaded back with AutoModelForCausalLM computes the dense
    model's logits, with and without padding on the left; generate() agrees too."""
    from unit.test_import_hf import VOCAB, make_hf  # tests/ is on sys.path (tests/conftest.py)
    from transformers import AutoModelForCausalLM

    from rlt_mega.checkpoint_tools import import_hf

    dense = make_hf(tmp_path / "hf", kind, **kwargs)
    out = import_hf(tmp_path / "hf", tmp_path / "rlt", memory_block=3)
    rlt = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(2, 3, dtype=torch.long), tokens], dim=1)
    mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones_like(tokens)], dim=1)
    with torch.no_grad():
        want = dense(tokens).logits.float()
        assert (rlt(tokens).logits - want).abs().max().item() < 1e-4
        assert (rlt(padded, attention_mask=mask).logits[:, 3:] - want).abs().max().item() < 1e-4
        ours = rlt.generate(tokens[:, :7], max_new_tokens=6, do_sample=False, pad_token_id=0)
        theirs = dense.generate(tokens[:, :7], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_transformers_loss_and_gradient_match_rlt_mega(exports):
    """Fine-tuning through transformers (labels -> loss -> backward) gives rlt_mega's dense
    loss and full-BPTT gradient."""
    from transformers import AutoModelForCausalLM

    path = exports[1][4]
    hf = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True)
    model = rlt_model(path)
    tokens = torch.randint(0, 259, (2, 15), generator=torch.Generator().manual_seed(3))
    loss = hf(tokens, labels=tokens).loss
    loss.backward()
    logits = model(tokens)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    ours, theirs = dict(model.named_parameters()), dict(hf.named_parameters())
    assert set(theirs) <= set(ours)
    for name, p in theirs.items():
        assert (p.grad - ours[name].grad).abs().max().item() < 1e-5, name
