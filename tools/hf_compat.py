"""Checks an export's modeling code (rlt_mega/checkpoint_tools/hf_code) against another
transformers version than the one rlt_mega's venv holds.

    .venv/bin/python tools/hf_compat.py make /tmp/hfc          # with rlt_mega: exports + reference
    OTHER_VENV/bin/python tools/hf_compat.py check /tmp/hfc    # any venv with torch + transformers

``make`` writes two tiny random exports (C = 4; untied / tied + qkv bias + unshared decoder)
and what rlt_mega computes for them (dense logits, greedy tokens and encoder calls of the
sampler). ``check`` loads them with AutoModelForCausalLM(trust_remote_code=True), rlt_mega
blocked, and prints whether logits (1e-5), greedy tokens with and without a cache, the cache's
encoder calls and beam search agree. Checked this way: transformers 4.57.6 and 5.24.0.
"""

import sys
from pathlib import Path

VARIANTS = {"plain": {}, "tied_bias_unshared": {"tie_embeddings": True, "qkv_bias": True, "share_weights": False}}


def make(out: Path) -> None:
    import torch

    from rlt_mega.checkpoint_tools import export_model
    from rlt_mega.config import ModelConfig
    from rlt_mega.model.rlt import build_model
    from rlt_mega.rollout import Processing, Sampler, SamplingParams

    base = dict(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, memory_block=4,
                max_seq_len=64)
    reference = {}
    for name, extra in VARIANTS.items():
        model = build_model(ModelConfig(**base, **extra), seed=1)
        export_model(model, None, out / name, tokenizer_dir="byte", overwrite=True)
        tokens = torch.randint(0, 259, (3, 13), generator=torch.Generator().manual_seed(0))
        prompt = tokens[0, :7].tolist()
        params = SamplingParams(Processing(temperature=0.0), max_new_tokens=12, stop_token_ids=(258,))
        ro = Sampler(model).generate([[prompt]], params, [[0]], pad_id=256)[0]
        with torch.no_grad():
            reference[name] = dict(tokens=tokens, logits=model(tokens), prompt=prompt, greedy=ro.completion(0),
                                   calls=[tuple(c) for c in ro.schedule.encoder_calls])
    torch.save(reference, out / "reference.pt")


def check(out: Path) -> int:
    sys.modules["rlt_mega"] = None  # the export must need nothing of rlt_mega
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    reference = torch.load(out / "reference.pt", weights_only=True)  # tensors, lists, tuples: no pickle runs
    ok = True
    for name, ref in reference.items():
        model = AutoModelForCausalLM.from_pretrained(str(out / name), trust_remote_code=True).eval()
        prompt = torch.tensor([ref["prompt"]])
        n = prompt.shape[1]
        with torch.no_grad():
            diff = (model(ref["tokens"]).logits - ref["logits"]).abs().max().item()
            res = model.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
            cache = res.get("cache") if res.get("cache") is not None else res.get("past_key_values")
            no_cache = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
            beams = [model.generate(prompt, max_new_tokens=8, num_beams=3, do_sample=False, use_cache=c) for c in (True, False)]
        checks = {"logits within 1e-5": diff < 1e-5, "greedy = sampler": res.sequences[0, n:].tolist() == ref["greedy"],
                  "no cache = cache": torch.equal(no_cache, res.sequences),
                  "encoder calls = sampler": cache is not None and cache.encoder_calls == ref["calls"],
                  "beam search, cache = no cache": torch.equal(*beams)}
        ok = ok and all(checks.values())
        print(name, f"(max logit diff {diff:.2e}):", ", ".join(f"{k}: {v}" for k, v in checks.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(__doc__)
    target = Path(sys.argv[2])
    if sys.argv[1] == "make":
        target.mkdir(parents=True, exist_ok=True)
        make(target)
    else:
        sys.exit(check(target))
