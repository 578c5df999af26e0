"""Where a training step's time goes, sampled: the step of tools/bench/training.py (a LocalEngine
step on one fixed micro-batch, the config's own checkpointing) run under py-spy with native
frames, each sample classified by its innermost native frame.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/step_profile.py --config configs/small_cpu.yaml
    ... --path module            # the module path instead of the fused decoder

Why sampling. torch.profiler times every operator with a hook of its own, which inflates the
time outside the kernels: at the decoder's sizes the per-operator cost is what is being measured.
py-spy reads the stacks from outside the process and sees the native frames too (it pauses the
process for each sample: at the default 50 Hz the step runs about 1.2x slower; the printed step
time is the sampled one), so it splits the step into the matrix kernels (MKL, oneDNN's JIT code), the
other ATen kernels, and the framework between them (the dispatcher and tensor bookkeeping, the
Python bindings, the interpreter, malloc).

py-spy is not a dependency of rlt_mega: ``pip install py-spy`` (it needs ptrace permission, which
containers sometimes withhold: then run it as root or with SYS_PTRACE).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

MARKER = "step_profile_loop"  # the function whose samples are counted (not the warm-up, not the imports)


def classify(leaf: str) -> str:
    """The category of a sample from its innermost frame (py-spy's "name (file)")."""
    if "mkl_blas" in leaf or "cblas" in leaf or "sgemm" in leaf or "dgemm" in leaf:
        return "MKL GEMM"
    if leaf.startswith("0x") and "(?)" in leaf:
        return "JIT code (oneDNN)"
    if "dnnl" in leaf:
        return "oneDNN other"
    if "libpython" in leaf or ".py:" in leaf or "(<frozen" in leaf:
        return "Python interpreter"
    if "libtorch_python" in leaf or "pybind11" in leaf:
        return "torch Python bindings"
    if "Vectorized" in leaf or "Sleef" in leaf or "kernel_impl" in leaf or "cpu_kernel" in leaf:
        return "ATen kernels"
    if "libc.so" in leaf or "ld-linux" in leaf:
        return "libc (malloc, memcpy)"
    return "ATen/c10 dispatch and bookkeeping"


def summarize(raw: str, top: int) -> None:
    cats, frames_py, gemm_callers = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if MARKER not in stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        cat = classify(frames[-1])
        cats[cat] += n
        ours = next((re.sub(r" \(rlt_mega/(.*?)\)", r" \1", f) for f in reversed(frames) if "rlt_mega/" in f), "(outside rlt_mega)")
        frames_py[ours] += n
        if cat in ("MKL GEMM", "JIT code (oneDNN)"):
            gemm_callers[ours] += n
    if not total:
        sys.exit("no samples inside the step loop: did py-spy attach (ptrace permission)?")
    print(f"{total} samples in the timed steps")
    print("\n## by innermost native frame")
    for k, v in cats.most_common():
        print(f"{v / total:7.1%}  {k}")
    print(f"\n## by innermost rlt_mega frame (file:line), top {top}")
    for k, v in frames_py.most_common(top):
        print(f"{v / total:7.1%}  {k}")
    print(f"\n## matrix kernels by caller, top {top}")
    for k, v in gemm_callers.most_common(top):
        print(f"{v / total:7.1%}  {k}")


def child(args) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    from training import make_step

    from rlt_mega.config import load_config

    base = load_config(args.config)
    B, T = base.train.micro_batch_size, base.data.seq_len
    model, cfg, step = make_step(args.config, T, B, fused=args.path == "fused")
    model.set_checkpointing(cfg.train.checkpointing)
    step(), step()  # warm-up: Adam state, the fused step's workspace

    def step_profile_loop():
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        return (time.perf_counter() - t0) / args.steps

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.config} ({B} x {T}), "
          f"{args.path} path: {step_profile_loop():.3f} s per step over {args.steps} steps", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/small_cpu.yaml")
    p.add_argument("--path", choices=["fused", "module"], default="fused")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rate", type=int, default=50,
                   help="samples per second (each native sample pauses the process: keep it low)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("py-spy not found on PATH: `pip install py-spy` (a sampling profiler), then run this again")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.raw")
        cmd = [spy, "record", "--native", "-r", str(args.rate), "-f", "raw", "-o", out, "--", sys.executable,
               os.path.abspath(__file__), "--child", "--config", args.config, "--path", args.path,
               "--steps", str(args.steps)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        print("\n".join(ln for ln in done.stdout.splitlines() if ln.strip() and not ln.startswith("py-spy>")))
        if done.returncode != 0 or not os.path.exists(out):
            sys.exit(f"py-spy failed (exit {done.returncode}):\n{done.stderr.strip()}")
        with open(out) as f:
            summarize(f.read(), args.top)


if __name__ == "__main__":
    main()
