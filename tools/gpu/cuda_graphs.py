"""GPU check of train.cuda_graphs: the dense schedule's decoder with its positions captured as
CUDA graphs (parallel/cuda_graphs.py) against the eager decoder step and the reference (rlt_mega/reference.py),
same weights.

    PYTHONPATH=. python tools/gpu/cuda_graphs.py [--d-model 256 --layers 4 --batch 8 --seq-len 128]

Prints one JSON line and exits 0 when the gradients agree (fp32: every parameter within 1e-4
relative, norm-wise, of the module path's; the captured and the eager fused step within 1e-5 of
each other), 1 when they do not, and 0 with "status": "skipped: no CUDA" where there is no CUDA
device (tools/gpu_check.sh's fused_cuda_graph part calls it anywhere). Also reports the forward+backward time of the three
paths (median of --repeats, after a warm-up that includes the capture).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _grads(model, x: torch.Tensor, reference: bool = False) -> tuple[float, dict]:
    from rlt_mega.reference import reference_forward

    for p in model.parameters():
        p.grad = None
    logits = reference_forward(model, x) if reference else model(x)
    w = torch.randn(logits.shape, generator=torch.Generator(device=x.device).manual_seed(1), device=x.device)
    loss = (logits * w).sum()
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a: dict, b: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for n in b:
        r = float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30))
        if r > worst:
            worst, where = r, n
    return worst, where


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    out = {"check": "cuda_graphs"}
    if not torch.cuda.is_available():
        out.update(status="skipped: no CUDA")
        print(json.dumps(out))
        return 0
    from rlt_mega.config import CheckpointingConfig, ModelConfig
    from rlt_mega.model import build_model

    cfg = ModelConfig(vocab_size=260, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                      memory_block=4, max_seq_len=max(1024, args.seq_len))
    device = torch.device("cuda")
    models = {
        "module": build_model(cfg, device, seed=0),  # run as the reference
        "fused": build_model(cfg, device, seed=0),
        "graphs": build_model(cfg, device, seed=0),
    }
    from rlt_mega.parallel.cuda_graphs import install_cuda_graphs

    install_cuda_graphs(models["graphs"])
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    x = x.to(device)
    results, times = {}, {k: [] for k in models}
    for name, model in models.items():
        results[name] = _grads(model, x, name == "module")  # the graphs' warm-up and capture happen here
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _grads(model, x, name == "module")
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    ckpt = build_model(cfg, device, seed=0)
    install_cuda_graphs(ckpt)
    ckpt.set_checkpointing(CheckpointingConfig(decoder="every_k", decoder_k=8))
    _, ckpt_grads = _grads(ckpt, x)
    graphs_vs_module, where = _rel(results["graphs"][1], results["module"][1])
    graphs_vs_fused, where_f = _rel(results["graphs"][1], results["fused"][1])
    ckpt_vs_graphs, _ = _rel(ckpt_grads, results["graphs"][1])
    ok = graphs_vs_module < 1e-4 and graphs_vs_fused < 1e-5 and ckpt_vs_graphs < 1e-6
    out.update(status="ok" if ok else "failed", device=torch.cuda.get_device_name(),
               graphs_vs_module=graphs_vs_module, worst_param=where, graphs_vs_fused=graphs_vs_fused,
               worst_param_vs_fused=where_f, checkpointed_vs_not=ckpt_vs_graphs,
               seconds={k: statistics.median(v) for k, v in times.items()},
               speedup_vs_module=statistics.median(times["module"]) / statistics.median(times["graphs"]),
               speedup_vs_fused_eager=statistics.median(times["fused"]) / statistics.median(times["graphs"]),
               shape=dict(d_model=args.d_model, layers=args.layers, batch=args.batch, seq_len=args.seq_len))
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
