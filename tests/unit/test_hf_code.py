"""The transformers remote code written into every export (rlt_mega/checkpoint_tools/hf_code/,
standalone: tests/e2e/test_hf_export.py loads it where rlt_mega cannot be imported) against the
executable reference (rlt_mega/reference.py) for every model variant, in float64: its dense
forward (no cache) and its cached schedule (deferred memory, one token at a time after the
prompt) give the reference's logits to 1e-10."""

import pytest
import torch
import transformers

from rlt_mega.checkpoint_tools import export_state_dict
from rlt_mega.config import ModelConfig
from rlt_mega.model.rlt import build_model
from rlt_mega.reference import reference_forward



BASE = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=64, init_std=0.2)
VARIANTS = {
    "C1_gqa": dict(memory_block=1, n_kv_heads=2),
    "C3_mqa_qkv_bias": dict(memory_block=3, n_kv_heads=1, qkv_bias=True),
    "C4_tied_own_decoder_blocks": dict(memory_block=4, n_kv_heads=4, tie_embeddings=True, share_weights=False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_remote_code_computes_the_reference(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = ModelConfig(**BASE, **VARIANTS[variant])
    model = build_model(cfg, seed=0)
    export_state_dict(model.state_dict(), cfg, tmp_path / "export", tokenizer="byte")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), trust_remote_code=True,
                                                           torch_dtype=torch.float64).eval()
    model = model.double()
    x = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference_forward(model, x)
        dense = hf(x).logits
        assert dense.dtype == torch.float64 and (dense - ref).abs().max() < 1e-10
        # the cached schedule: a prompt of 5 tokens, then one token a call
        out = hf(x[:, :5], use_cache=True)
        steps, cache = [out.logits], out.past_key_values if hasattr(out, "past_key_values") else out.cache
        for t in range(5, 13):
            out = hf(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
            steps.append(out.logits)
        assert (torch.cat(steps, dim=1) - ref).abs().max() < 1e-10
