"""GPU check of train.cuda_graphs: the dense schedule's decoder with its positions captured as
CUDA graphs (parallel/cuda_graphs.py) against the eager decoder step and the reference
(rlt_mega/reference.py), same weights, under the real run's determinism settings
(train.deterministic=true, rlt_mega/determinism.py: torch's deterministic kernels, so the
``index_copy_`` inside the captured bodies takes the deterministic ``index_put_`` path) and with
them off.

    PYTHONPATH=. python tools/gpu/cuda_graphs.py [--d-model 256 --layers 4 --batch 8 --seq-len 128]

Under tensor parallelism the captured bodies hold the all-reduces: a world-of-one group (NCCL on
a GPU) runs them inside the capture, and with deterministic kernels the captured step must equal
the same step run eagerly bit for bit ("tp_world_of_one_bit_equal").

Prints one JSON line and exits 0 when, in both modes, the gradients agree (fp32: every parameter
within 1e-4 relative, norm-wise, of the module path's; the captured and the eager fused step
within 1e-5 of each other; checkpointed within 1e-6 of not), 1 when they do not. Also reports the
forward+backward time of the three paths and per position (median of --repeats, after a warm-up
that includes the capture). Without CUDA: "status": "skipped: no CUDA", exit 0; ``--smoke`` then
runs the same comparison on the CPU with the captured bodies called directly (capture=False, as
the unit tests do), so the comparison itself is exercised everywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TOLERANCES = {"graphs_vs_module": 1e-4, "graphs_vs_fused": 1e-5, "checkpointed_vs_not": 1e-6}


def _grads(model, x: torch.Tensor, reference: bool = False) -> tuple[float, dict]:
    from rlt_mega.reference import reference_forward

    for p in model.parameters():
        p.grad = None
    logits = reference_forward(model, x) if reference else model(x)
    w = torch.randn(logits.shape, generator=torch.Generator(device=x.device).manual_seed(1), device=x.device)
    loss = (logits * w).sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a: dict, b: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for n in b:
        r = float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30))
        if r > worst or (r != r):  # NaN counts as worst
            worst, where = r, n
    return worst, where


def verdict(distances: dict) -> str:
    """{name in TOLERANCES: relative distance} -> "ok" or "fail: ..." (pure: the tests feed it)."""
    over = [f"{k} {v:.3g} > {TOLERANCES[k]:g}" for k, v in distances.items() if not v <= TOLERANCES[k]]
    return "ok" if not over else "fail: " + ", ".join(over)


def _graphed(model) -> None:
    from rlt_mega.parallel.cuda_graphs import GraphedDecoder, install_cuda_graphs

    if next(model.parameters()).is_cuda:
        install_cuda_graphs(model)
    else:  # --smoke on the CPU: the same object with its bodies called directly (capture=False)
        model.decoder = GraphedDecoder(all_reduce=model.decoder.all_reduce)


def _world_of_one_reduce(device):
    """An in-place sum over a one-rank process group (NCCL on a GPU, gloo on the CPU): the
    tensor-parallel all-reduce the captured bodies hold under TP, on a world of one."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    group = dist.new_group([0])
    return lambda x: dist.all_reduce(x, group=group)


def world_of_one(cfg, device, x: torch.Tensor) -> dict:
    """train.cuda_graphs under tensor parallelism: the decoder with its all-reduces inside the
    captured bodies (a world of one) against the same capture-ready step run eagerly, gradients
    compared bit for bit (required with deterministic kernels)."""
    from rlt_mega.model.dense_decode import Decoder
    from rlt_mega.model.rlt import build_model
    from rlt_mega.parallel.cuda_graphs import GraphedDecoder

    reduce = _world_of_one_reduce(device)
    eager, graphed = build_model(cfg, device, seed=0), build_model(cfg, device, seed=0)
    eager.decoder = Decoder(all_reduce=reduce, static=True)
    graphed.decoder = GraphedDecoder(all_reduce=reduce, capture=device.type == "cuda")
    _, a = _grads(eager, x)
    _grads(graphed, x)  # the warm-up and capture
    _, b = _grads(graphed, x)
    return {"tp_world_of_one_bit_equal": all(torch.equal(a[n], b[n]) for n in a),
            "tp_world_of_one_rel": _rel(b, a)[0]}


def check(cfg, device, args, inject: bool = False) -> dict:
    from rlt_mega.config import CheckpointingConfig
    from rlt_mega.model.rlt import build_model

    models = {"module": build_model(cfg, device, seed=0),  # run as the reference
              "fused": build_model(cfg, device, seed=0), "graphs": build_model(cfg, device, seed=0)}
    _graphed(models["graphs"])
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    x = x.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results, times = {}, {k: [] for k in models}
    for name, model in models.items():
        results[name] = _grads(model, x, name == "module")  # the graphs' warm-up and capture happen here
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            _grads(model, x, name == "module")
            sync()
            times[name].append(time.perf_counter() - t0)
    ckpt = build_model(cfg, device, seed=0)
    _graphed(ckpt)
    ckpt.set_checkpointing(CheckpointingConfig(decoder="every_k", decoder_k=8))
    _, ckpt_grads = _grads(ckpt, x)
    graphs = results["graphs"][1]
    if inject:  # the self-test: one parameter's gradient 0.1% off must fail the check (tolerances, not bits)
        graphs = {n: (v * 1.001 if i == 0 else v) for i, (n, v) in enumerate(graphs.items())}
    distances = {"graphs_vs_module": _rel(graphs, results["module"][1])[0],
                 "graphs_vs_fused": _rel(graphs, results["fused"][1])[0],
                 "checkpointed_vs_not": _rel(ckpt_grads, graphs)[0]}
    med = {k: statistics.median(v) for k, v in times.items()}
    tp = world_of_one(cfg, device, x)
    status = verdict(distances)
    if status == "ok" and args.require_bits and not tp["tp_world_of_one_bit_equal"]:
        status = f"fail: captured TP step (world of one) differs from the eager one: {tp['tp_world_of_one_rel']:.3g}"
    return {"status": status, **distances, **tp,
            "graphs_equal_fused": all(torch.equal(graphs[n], results["fused"][1][n]) for n in graphs),
            "seconds": med, "ms_per_position": {k: 1000 * v / args.seq_len for k, v in med.items()},
            "position_speedup_vs_fused_eager": med["fused"] / med["graphs"],
            "speedup_vs_module": med["module"] / med["graphs"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--deterministic", choices=["both", "on", "off"], default="both",
                   help="train.deterministic's kernels: on (the real run's default), off, or on then off")
    p.add_argument("--smoke", action="store_true", help="without CUDA: the comparison on the CPU, uncaptured")
    p.add_argument("--inject", action="store_true", help="self-test: perturb a captured gradient; must fail")
    args = p.parse_args()
    out: dict = {"check": "cuda_graphs"}
    if not torch.cuda.is_available() and not args.smoke:
        out.update(status="skipped: no CUDA")
        print(json.dumps(out))
        return 0
    from rlt_mega import determinism
    from rlt_mega.config import ModelConfig

    cfg = ModelConfig(vocab_size=260, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                      memory_block=4, max_seq_len=max(1024, args.seq_len))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modes = {"both": ["on", "off"], "on": ["on"], "off": ["off"]}[args.deterministic]
    failed = []
    for mode in modes:  # on first: configure(True) pins cuBLAS's workspace before any CUDA work
        determinism.configure(mode == "on")
        args.require_bits = mode == "on"
        try:
            out[f"deterministic_{mode}"] = r = check(cfg, device, args, args.inject)
        except Exception as exc:  # a capture that fails (an op that syncs or is not capturable) is the finding
            out[f"deterministic_{mode}"] = r = {"status": f"fail: {type(exc).__name__}: {str(exc)[:300]}"}
        if r["status"] != "ok":
            failed.append(f"deterministic {mode}: {r['status']}")
    determinism.configure(True)
    out.update(status="ok" if not failed else "fail: " + "; ".join(failed), device=str(
        torch.cuda.get_device_name() if device.type == "cuda" else "cpu (uncaptured)"),
        shape=dict(d_model=args.d_model, layers=args.layers, batch=args.batch, seq_len=args.seq_len))
    print(json.dumps(out))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
