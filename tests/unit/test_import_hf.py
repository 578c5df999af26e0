"""Import of dense Llama/Qwen2 checkpoints (docs/design.md, "The model"): tiny random models built with
HF transformers from a config (no download), saved with save_pretrained, imported; the RLT's
logits must equal the dense model's. Plus the inputs the importer must refuse, by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlt_mega.checkpoint_tools import CheckpointFormatError, convert_hf, import_hf, load_exported
from rlt_mega.model.rlt import RLT

transformers = pytest.importorskip("transformers")

VOCAB, D, FFN, L = 64, 32, 48, 2


def make_hf(path, kind="llama", *, heads=4, kv_heads=4, tied=False, theta=10000.0, seed=0,
            max_shard_size=None, **extra):
    """A tiny random HF causal LM saved under path; its weights perturbed away from the HF
    init (biases 0, norms 1) so that every imported tensor matters for the logits."""
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    cfg = cls_cfg(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_hidden_layers=L,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                  rope_parameters={"rope_type": "default", "rope_theta": theta}, max_position_embeddings=64,
                  rms_norm_eps=1e-5, **extra)
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def rlt_from_export(path):
    cfg, sd = load_exported(path)
    model = RLT(cfg).eval()
    model.load_state_dict(sd)
    return model


CASES = {
    # name: (kind, make_hf kwargs, import kwargs)
    "llama_gqa_tied_theta": ("llama", dict(heads=4, kv_heads=2, tied=True, theta=5000.0), {}),
    "llama_untied_sharded_C3": ("llama", dict(heads=2, kv_heads=2, max_shard_size="8KB"), dict(memory_block=3)),
    "qwen2_gqa_untied_bias": ("qwen2", dict(heads=4, kv_heads=2, theta=1e6), {}),
    "qwen2_mqa_tied": ("qwen2", dict(heads=4, kv_heads=1, tied=True, theta=20000.0), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_logits_equal_dense_model(tmp_path, case):
    kind, hf_kwargs, import_kwargs = CASES[case]
    hf = make_hf(tmp_path / "hf", kind, **hf_kwargs)
    out = import_hf(tmp_path / "hf", tmp_path / "rlt", **import_kwargs)
    model = rlt_from_export(out)
    cfg = model.cfg
    assert (cfg.n_kv_heads, cfg.tie_embeddings, cfg.qkv_bias) == (
        hf.config.num_key_value_heads, hf.config.tie_word_embeddings, kind == "qwen2")
    assert cfg.rope_theta == hf_kwargs.get("theta", 10000.0) and cfg.norm_eps == 1e-5
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = hf(tokens).logits.float()
        ours = model(tokens)
    assert dense.std() > 0.5  # the perturbed model's logits are far from uniform
    assert (ours - dense).abs().max().item() < 1e-4


def test_import_zero_and_random_weights(tmp_path):
    make_hf(tmp_path / "hf", "qwen2", heads=4, kv_heads=2)
    cfg, sd, source = convert_hf(tmp_path / "hf", seed=3)
    _, sd_again, _ = convert_hf(tmp_path / "hf", seed=3)
    _, sd_other, _ = convert_hf(tmp_path / "hf", seed=4)
    hf_sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for i in range(cfg.n_layers):
        assert not sd[f"cross.{i}.attn.o.weight"].any()
        for x in "qkv":
            w = sd[f"cross.{i}.attn.{x}.weight"]
            assert 0.5 * cfg.init_std < w.std() < 2 * cfg.init_std  # a sound init: the model's own
        assert torch.equal(sd[f"blocks.{i}.attn.q.bias"], hf_sd[f"model.layers.{i}.self_attn.q_proj.bias"])
    assert not sd["recur_proj.weight"].any()
    assert all(torch.equal(sd[n], sd_again[n]) for n in sd)  # seeded
    assert not torch.equal(sd["cross.0.attn.q.weight"], sd_other["cross.0.attn.q.weight"])
    assert source["kind"] == "hf_import" and source["model_type"] == "qwen2"


def test_import_bf16_copies_weights_bit_for_bit(tmp_path):
    make_hf(tmp_path / "hf", "llama", heads=4, kv_heads=2)
    out = import_hf(tmp_path / "hf", tmp_path / "rlt", dtype="bf16")
    _, sd = load_exported(out)
    hf_sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert torch.equal(sd["blocks.1.mlp.down.weight"], hf_sd["model.layers.1.mlp.down_proj.weight"].bfloat16())


def test_import_copies_tokenizer_files(tmp_path):
    make_hf(tmp_path / "hf", "llama")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    out = import_hf(tmp_path / "hf", tmp_path / "rlt")
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert json.loads((out / "rlt_export.json").read_text())["tokenizer"] == ["tokenizer.json"]


# ------------------------------------------------------------------------------ refused inputs

def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf(path, "llama", heads=4, kv_heads=2)
    return path


@pytest.fixture
def hf_copy(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("changes, expected", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type='gpt2'"),
    (dict(architectures=["LlamaModel"]), "architectures ['LlamaModel']"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "rope_type='llama3'"),
    (dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}), "rope_type='linear'"),
    (dict(attention_bias=True), "o_proj"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8,
          max_window_layers=1), "sliding-window"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
          layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
])
def test_import_refuses_unsupported_config(hf_copy, tmp_path, changes, expected):
    _edit_config(hf_copy, **changes)
    with pytest.raises(CheckpointFormatError) as err:
        import_hf(hf_copy, tmp_path / "rlt")
    assert str(hf_copy / "config.json") in str(err.value) and expected in str(err.value)
    assert not (tmp_path / "rlt").exists()


def test_import_missing_config(hf_copy, tmp_path):
    (hf_copy / "config.json").unlink()
    with pytest.raises(CheckpointFormatError, match=r"config\.json: missing"):
        import_hf(hf_copy, tmp_path / "rlt")


def test_import_wrong_tensor_shape(hf_copy, tmp_path):
    file = hf_copy / "model.safetensors"
    sd = load_file(str(file))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(FFN + 2, D)
    save_file(sd, str(file))
    with pytest.raises(CheckpointFormatError) as err:
        import_hf(hf_copy, tmp_path / "rlt")
    msg = str(err.value)
    assert str(file) in msg and "model.layers.1.mlp.up_proj.weight" in msg and f"({FFN + 2}, {D})" in msg


def test_import_truncated_safetensors(hf_copy, tmp_path):
    file = hf_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(CheckpointFormatError) as err:
        import_hf(hf_copy, tmp_path / "rlt")
    assert str(file) in str(err.value) and "truncated" in str(err.value)


def test_import_missing_tensor_and_missing_shard(tmp_path):
    make_hf(tmp_path / "hf", "llama", max_shard_size="8KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointFormatError, match=f"{shards[-1].name}: missing"):
        import_hf(tmp_path / "hf", tmp_path / "rlt")
