"""Low-rank adapters through the CLI (issue 30): a run continued from an export with model.lora
checkpoints the adapters only (and the base's hash), resumes bit for bit, and exports as a full
merged export (``export --merge``, loaded by transformers) and as a peft adapter directory
(``export --adapters``) that peft loads onto the transformers export of the base, with the
merged export's logits (1e-5)."""

import json

import pytest
import torch

from rlt_mega import cli
from rlt_mega.checkpoint import load_torch
from rlt_mega.checkpoint_tools import export_model
from rlt_mega.config import load_config
from rlt_mega.model.rlt import build_model

TINY = ["model.vocab_size=260", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=64", "model.memory_block=2", "model.max_seq_len=16", "data.seq_len=12",
        "data.generated.num_train=40", "data.generated.num_eval=4", "train.micro_batch_size=2", "train.eval_every=0",
        "train.log_every=1", "train.device=cpu", "logging.progress=false", "optim.warmup_steps=0", "optim.lr=0.01",
        "model.lora.rank=4", "model.lora.alpha=8"]


def args(tmp, name, steps, *extra):
    return ["pretrain", *TINY, f"train.init_from={tmp / 'base'}", f"train.steps={steps}",
            f"checkpoint.dir={tmp / name / 'ckpt'}", f"logging.dir={tmp / name / 'tb'}", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    cfg = load_config(None, TINY)
    export_model(build_model(cfg.model, seed=7), None, tmp / "base", tokenizer_dir="byte")
    assert cli.main(args(tmp, "a", 3, "checkpoint.every=2")) == 0
    return tmp


def test_checkpoint_holds_adapters_only_and_resumes_exactly(run, capsys):
    step = run / "a" / "ckpt" / "step_00000003"
    assert (step / "adapters.safetensors").is_file() and not (step / "model.safetensors").exists()
    assert json.loads((step / "base.json").read_text())["sha256"]
    engine_state = load_torch(step / "engine.pt", deepspeed=True)
    n_opt = sum(len(s["params"]) for s in engine_state["optimizer"]["param_groups"])
    assert n_opt == 2 * (7 * 2 + 4 * 2 + 1)  # A and B of every adapter, nothing of the base
    # resume from step 2 and take step 3 again: the same adapters, bit for bit
    (run / "b").mkdir()
    import shutil

    shutil.copytree(run / "a" / "ckpt", run / "b" / "ckpt", ignore=shutil.ignore_patterns("step_00000003"))
    (run / "b" / "ckpt" / "latest").write_text("step_00000002")
    assert cli.main(args(run, "b", 3, "train.resume=auto")) == 0
    from rlt_mega.metrics import read_metrics

    assert [r["step"] for r in read_metrics(run / "b" / "tb") if "train/loss" in r] == [3]  # resumed at 2
    from safetensors.torch import load_file

    a = load_file(str(step / "adapters.safetensors"))
    b = load_file(str(run / "b" / "ckpt" / "step_00000003" / "adapters.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(b[k].abs().max() > 0 for k in b if k.endswith("lora_B"))  # the adapters trained
    # the same checkpoint on another base: refused, naming the hashes
    cfg = load_config(None, TINY)
    export_model(build_model(cfg.model, seed=8), None, run / "other", tokenizer_dir="byte")
    other = [a for a in args(run, "b", 4, "train.resume=auto") if not a.startswith("train.init_from")]
    assert cli.main([*other, f"train.init_from={run / 'other'}"]) == 2
    assert "its adapters were trained on a base of sha256" in capsys.readouterr().err


def test_merged_and_peft_exports_agree(run, capsys):
    import peft
    import transformers

    src = run / "a" / "ckpt"
    assert cli.main(["export", str(src), str(run / "plain")]) == 2
    assert "holds adapters: export with --merge" in capsys.readouterr().err
    assert cli.main(["export", str(src), str(run / "merged"), "--merge"]) == 0
    assert cli.main(["export", str(src), str(run / "peft"), "--adapters"]) == 0
    assert json.loads((run / "peft" / "adapter_config.json").read_text())["r"] == 4
    tokens = torch.randint(0, 260, (2, 12), generator=torch.Generator().manual_seed(0))

    def hf(path):
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True,
                                                                  dtype=torch.float32).eval()

    with torch.no_grad():
        merged = hf(run / "merged")(tokens).logits
        base = hf(run / "base")
        base_logits = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, str(run / "peft")).eval()
        got = adapted(tokens).logits
    assert (got - merged).abs().max() <= 1e-5
    assert (base_logits - merged).abs().max() > 1e-3  # the adapters changed the model
