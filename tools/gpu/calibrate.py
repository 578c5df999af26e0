"""The planner's decoder tick against a measured one (docs/cost_model.md: the roofline's
assumed efficiencies, checked on a GPU).

For each rows-per-step B and n_kv_heads, one shape that fits one GPU: the dense schedule's
decoder (train.cuda_graphs: positions captured as CUDA graphs on a GPU; the eager step on the
CPU) runs a forward and a backward over T positions; the time per position (a tick) is printed
beside the planner's prediction for the same shape on one GPU (cost/planner.step_time:
decoder_tick_fwd, decoder_tick_bwd at tp = pp = dp = 1), and the ratios measured / predicted go
to --out as JSON. ``rlt-mega plan --calibration FILE`` then scales the roofline's decoder tick by
their median (planner.load_calibration).

    PYTHONPATH=. python tools/gpu/calibrate.py --out calibration.json          # on a GPU, < 3 min
    PYTHONPATH=. python tools/gpu/calibrate.py --smoke --out /tmp/c.json       # tiny, any device

Defaults (a GPU): d=2048, 4 layers, T=2048, B in {1, 4, 16, 64, 256}, n_kv_heads in {16, 2},
bf16. ``--smoke``: d=64, 2 layers, T=16, B in {1, 4}, n_kv_heads in {4, 2}, fp32, on the CPU
when there is no GPU (the planner's prediction is still an H100's: the ratios then say nothing
about the GPU; the smoke form checks the script end to end, tests/unit/test_calibrate.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def predicted_ticks(model_cfg, B: int, T: int, dtype: str) -> tuple[float, float]:
    """The planner's forward and backward decoder tick (s) for B rows at T on one GPU."""
    from rlt_mega.config import CheckpointingConfig
    from rlt_mega.cost.layout import Layout
    from rlt_mega.cost.planner import Hardware, step_time

    layout = Layout(seq_len=T, micro_batch_size=B, dtype=dtype, checkpointing=CheckpointingConfig())
    parts = step_time(model_cfg, layout, Hardware(nodes=1, gpus_per_node=1))
    return parts["decoder_tick_fwd"], parts["decoder_tick_bwd"]


def measure_ticks(model, B: int, T: int, device: torch.device, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Median forward and backward time per position (s) of the dense decoder over T positions."""
    cfg = model.cfg
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(B, T, cfg.d_model, generator=g).to(device, dtype).requires_grad_()
    m = torch.randn(B, T, cfg.d_model, generator=g).to(device, dtype)
    fwd, bwd = [], []
    for i in range(repeats + 1):  # the first: warm-up (and the capture)
        mem = model.memory_kv(m)
        sync()
        t0 = time.perf_counter()
        z = model.decoder.dense(model, emb, mem)
        sync()
        t1 = time.perf_counter()
        z.backward(torch.ones_like(z))
        sync()
        t2 = time.perf_counter()
        if i:
            fwd.append((t1 - t0) / T)
            bwd.append((t2 - t1) / T)
        emb.grad = None
        model.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


def calibrate(args) -> dict:
    from rlt_mega.config import ModelConfig
    from rlt_mega.model.rlt import build_model
    from rlt_mega.parallel.cuda_graphs import install_cuda_graphs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    for kv in args.kv_heads:
        cfg = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                          n_kv_heads=kv, max_seq_len=args.seq_len)
        model = build_model(cfg, device, seed=0).to(dtype)
        if device.type == "cuda":
            install_cuda_graphs(model)
        for B in args.batch:
            pf, pb = predicted_ticks(cfg, B, args.seq_len, args.dtype)
            mf, mb = measure_ticks(model, B, args.seq_len, device, dtype, args.repeats)
            row = {"B": B, "n_kv_heads": kv, "predicted_fwd_ms": pf * 1e3, "measured_fwd_ms": mf * 1e3,
                   "predicted_bwd_ms": pb * 1e3, "measured_bwd_ms": mb * 1e3,
                   "ratio_fwd": mf / pf, "ratio_bwd": mb / pb}
            rows.append(row)
            print(f"B={B:<4} n_kv_heads={kv:<3} fwd {row['predicted_fwd_ms']:9.3f} ms predicted "
                  f"{row['measured_fwd_ms']:9.3f} measured ({row['ratio_fwd']:.2f}x)   bwd "
                  f"{row['predicted_bwd_ms']:9.3f} / {row['measured_bwd_ms']:9.3f} ({row['ratio_bwd']:.2f}x)",
                  flush=True)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: the ratios say nothing of a GPU)"
    return {"device": gpu, "date": datetime.date.today().isoformat(), "dtype": args.dtype,
            "shape": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "seq_len": args.seq_len},
            "cuda_graphs": device.type == "cuda", "rows": rows,
            "decoder_efficiency": statistics.median([r[k] for r in rows for k in ("ratio_fwd", "ratio_bwd")])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, any device")
    p.add_argument("--out", default=None, help="the JSON (rows: predicted, measured, ratios)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.d_model, args.layers, args.heads, args.seq_len = 64, 2, 4, 16
        args.batch, args.kv_heads, args.dtype = [1, 4], [4, 2], "fp32"
        args.repeats = min(args.repeats, 2)
    else:
        args.d_model, args.layers, args.heads, args.seq_len = 2048, 4, 16, 2048
        args.batch, args.kv_heads, args.dtype = [1, 4, 16, 64, 256], [16, 2], "bf16"
    result = calibrate(args)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
