"""Runs exports through transformers in a process where rlt_mega cannot be imported (the
parent, tests/e2e/test_hf_export.py, compares what it writes with rlt_mega).

    python tests/e2e/hf_export_worker.py REQUEST.json OUT.pt

REQUEST: {"exports": {name: dir}, "tokens": [[ids]] (a batch for the logits),
"prompts": [[ids]], "max_new_tokens": N, "texts": [str] (for the tokenizer)}.
"""

import sys

sys.modules["rlt_mega"] = None  # before anything else: `import rlt_mega` (or any rlt_mega.x) now fails

import json  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def blocked() -> bool:
    try:
        import rlt_mega  # noqa: F401
    except ImportError:
        return True
    return False


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def run_export(path: str, request: dict) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # transformers 5 reads config.json (auto_map) first
    model.eval()
    N = request["max_new_tokens"]
    out = {"class": type(model).__name__, "module": type(model).__module__, "eos": model.generation_config.eos_token_id}
    with torch.no_grad():
        out["logits"] = model(torch.tensor(request["tokens"])).logits
        greedy, no_cache, calls = [], [], []
        for p in request["prompts"]:
            ids = torch.tensor([p])
            res = model.generate(ids, max_new_tokens=N, do_sample=False, return_dict_in_generate=True)
            greedy.append(res.sequences[0, len(p):].tolist())
            calls.append([list(c) for c in (res.get("cache") or res.get("past_key_values")).encoder_calls])
            no_cache.append(model.generate(ids, max_new_tokens=N, do_sample=False, use_cache=False)[0, len(p):].tolist())
        out["greedy"], out["greedy_no_cache"], out["encoder_calls"] = greedy, no_cache, calls
        out["greedy_text"] = [tok.decode(g, skip_special_tokens=True) for g in greedy]
        ids, mask = left_padded(request["prompts"], tok.pad_token_id)
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        out["batched"] = batched[:, ids.shape[1]:].tolist()
    out["tok_encode"] = [tok(t, add_special_tokens=False)["input_ids"] for t in request["texts"]]
    out["tok_decode"] = [tok.decode(ids, skip_special_tokens=True) for ids in out["tok_encode"]]
    out["tok_decode_all"] = [tok.decode(ids) for ids in out["tok_encode"]]
    out["tok_special"] = [tok.eos_token_id, tok.pad_token_id, tok.bos_token_id]
    return out


def main() -> None:
    request = json.load(open(sys.argv[1]))
    results = {"rlt_mega_blocked": blocked(), "rlt_mega_loaded": any(m.startswith("rlt_mega.") for m in sys.modules)}
    for name, path in request["exports"].items():
        results[name] = run_export(path, request)
    results["rlt_mega_loaded"] = results["rlt_mega_loaded"] or any(
        m.startswith("rlt_mega") and sys.modules[m] is not None for m in sys.modules)
    torch.save(results, sys.argv[2])


if __name__ == "__main__":
    main()
