"""``rlt-mega reshard`` of the small config: its time and its peak resident memory.

A one-process run of configs/small_cpu.yaml takes one step and saves (manifest, config.yaml,
the layout-free state); then ``rlt-mega reshard`` cuts it for tp=2 x pp=2 ZeRO-1 (and back) in
a fresh process each, timed (s: the conversion, s(all): the process with its imports and a
first conversion of a tiny checkpoint, which imports what the tool imports lazily), and its peak
resident set is measured above the resident set before it (VmHWM reset through
/proc/self/clear_refs, Linux). Targets (issue 43):
under 30 s, and the peak above the imports' under 2x the largest parameter's state (fp32
master + two moments) plus one bucket (the bucket set small here, 8 MB, so that it is not the
whole state).

    python tools/bench/reshard.py [--json docs/bench/reshard.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Results, add_json_arg

ROOT = Path(__file__).resolve().parents[2]
BUCKET = 8 << 20

CHILD = r"""
import gc, sys, time, json
t0 = time.perf_counter()
from rlt_mega.checkpoint_tools.reshard_ckpt import reshard
import rlt_mega.checkpoint_tools.commands  # everything the CLI imports


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])


out = {}
args = sys.argv[3:]
if sys.argv[1] != "imports":  # a tiny checkpoint first: what the reshard imports lazily (megatron's layers...)
    reshard(sys.argv[1], sys.argv[2], *map(int, args[2:6]), bucket_bytes=int(args[6]))
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM, the peak resident set, to the current one
    f.write("5")
out["import_kb"] = base
if sys.argv[1] != "imports":
    t1 = time.perf_counter()
    s = reshard(args[0], args[1], *map(int, args[2:6]), bucket_bytes=int(args[6]))
    out.update(seconds=time.perf_counter() - t1, bytes_read=s["bytes_read"], bytes_written=s["bytes_written"])
out["peak_kb"] = status("VmHWM")
out["total_seconds"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def child(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_checkpoint(root: Path, config: str = "small_cpu") -> tuple[Path, int]:
    """One step of ``config`` in one process, saved: (step directory, largest parameter's elements)."""
    import torch

    from rlt_mega.checkpoint import CheckpointManager
    from rlt_mega.config import load_config, save_config
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.train.builders import build_engine

    cfg = load_config(ROOT / "configs" / f"{config}.yaml")
    dims = ParallelDims.single(cfg.model, "cpu")
    engine = build_engine(cfg, dims)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65), generator=g)
    engine.train_step([{"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}])

    def write(tmp: Path) -> None:
        engine.save(tmp)
        save_config(cfg, tmp / "config.yaml")

    path = CheckpointManager(root).save(1, write, meta={"layout": engine.layout()})
    return path, max(p.numel() for p in engine.module.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_arg(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlt_reshard_bench_") as tmp:
        src, largest = make_checkpoint(Path(tmp) / "ckpt")
        tiny, _ = make_checkpoint(Path(tmp) / "tiny", "tiny_cpu")
        imports = child("imports")
        there = child(str(tiny), str(Path(tmp) / "w1"), str(src), str(Path(tmp) / "tp4pp2"), "2", "2", "1", "1",
                      str(BUCKET))
        back = child(str(tiny), str(Path(tmp) / "w2"), str(Path(tmp) / "tp4pp2"), str(Path(tmp) / "one"), "1", "1",
                     "1", "0", str(BUCKET))
    bound_kb = (2 * 12 * largest + BUCKET) / 1024
    rows = []
    for name, r in (("one process -> tp=2 pp=2 ZeRO-1", there), ("tp=2 pp=2 ZeRO-1 -> one process", back)):
        above = r["peak_kb"] - r["import_kb"]
        rows.append({"move": name, "seconds": round(r["seconds"], 3),                      "total_seconds": round(r["total_seconds"], 3),
                     "mb_read": round(r["bytes_read"] / 1e6, 2), "mb_written": round(r["bytes_written"] / 1e6, 2),
                     "peak_mb": round(r["peak_kb"] / 1024, 1), "imports_mb": round(r["import_kb"] / 1024, 1), "above_imports_mb": round(above / 1024, 1),
                     "bound_mb": round(bound_kb / 1024, 1), "peak_ratio_to_bound": round(above / bound_kb, 3),
                     "under_30s": r["total_seconds"] < 30, "under_bound": above < bound_kb})
    print(f"small_cpu: largest parameter {largest:,} elements ({12 * largest / 1e6:.1f} MB of state), bucket "
          f"{BUCKET / 1e6:.1f} MB; the tool's imports hold "
          f"{imports['import_kb'] / 1024:.1f} MB resident; 'above': the peak resident set during the reshard minus "
          "the resident set before it (VmHWM reset through /proc/self/clear_refs)")
    print(f"{'move':<34} {'s':>7} {'s(all)':>7} {'MB read':>8} {'MB wrote':>8} {'peak MB':>8} {'above':>7} "
          f"{'bound':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r['move']:<34} {r['seconds']:>7.2f} {r['total_seconds']:>7.2f} {r['mb_read']:>8.2f} "
              f"{r['mb_written']:>8.2f} {r['peak_mb']:>8.1f} {r['above_imports_mb']:>7.1f} {r['bound_mb']:>7.1f} "
              f"{r['peak_ratio_to_bound']:>6.3f}")
    results = Results("reshard", args)
    results.row("setup", largest_parameter=largest, bucket_bytes=BUCKET,
                imports_mb=round(imports["import_kb"] / 1024, 1))
    for r in rows:
        results.row("moves", **r)
        results.target(f"reshard {r['move']}: whole process", "< 30 s", f"{r['total_seconds']:.2f} s",
                       r["under_30s"])
        results.target(f"reshard {r['move']}: peak resident above the imports",
                       "< 2 x largest parameter's state + one bucket",
                       f"{r['above_imports_mb']:.1f} MB of {r['bound_mb']:.1f} MB", r["under_bound"])
    results.write()


if __name__ == "__main__":
    main()
