"""Would compiling the fused decoder's per-position step reach issue 11's FLOP rate? (A
measurement, not a test: it asserts nothing.)

The capture-ready form of the fused step (model/decoder.py, ``static=True``) has shapes that do
not depend on t, so its per-position bodies (parallel/cuda_graphs.py: forward, recompute, backward)
can be compiled once by torch.compile (inductor, C++ on CPU) as they are captured on a GPU. Two
things in the code as it is stop inductor, and this benchmark works around both for the
experiment only:

- the run's buffers are views of one slab (model/fused_state.Slab), and aot_autograd refuses
  mutated inputs that alias each other: here each buffer gets its own allocation;
- the products are oneDNN linears on prepacked weights, and inductor's oneDNN lowering needs the
  weights to be graph constants (which training weights are not): here the products are plain
  ``torch.mm`` (``fused.MKLDNN_MIN_ELEMENTS`` raised), which inductor lowers itself.

Printed: the decoder's forward + backward time (dense schedule, full BPTT; d=512 H=8 ffn=1408
L=4, B=8, T=64, as ``training.py --only flops``) on the eager fused path (oneDNN products), the
capture-ready form uncompiled with plain products, and compiled, with the compile time.

    TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/compiled_step.py
"""

from __future__ import annotations

import time

import torch

import rlt_mega.model.kernels as fused
import rlt_mega.model.workspace as fused_state
import rlt_mega.parallel.cuda_graphs as cuda_graphs
from rlt_mega.model.dense_decode import Decoder
from harness import Results, add_common_args, add_json_arg, best_of_rounds, describe, setup
from rlt_mega.config import load_config
from rlt_mega.model.rlt import build_model


def separate_buffers(self, owner, pooled=True):
    """Slab.allocate with one allocation per buffer (no aliasing between them)."""
    return {name: torch.zeros(shape, dtype=dtype, device=self.device) for name, shape, dtype, _ in self._specs}


def report(res: Results, times: dict[str, float], compile_s: float, header: str) -> None:
    """Prints each path's decoder forward + backward seconds (``times``, the eager fused path first)
    and its ratio to the eager path, and records them in ``res``."""
    print(f"# compiled step: {header}; compile {compile_s:.0f} s (wall)")
    ref = next(iter(times.values()))
    for label, t in times.items():
        print(f"{label:<40} {t:7.2f} s  {t / ref:5.2f}x the eager fused path")
        res.row(f"decoder forward + backward, {header}", path=label, s=round(t, 2),
                **{"x eager fused": round(t / ref, 2), "compile s (wall)": round(compile_s) if "compiled" in label else ""})


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the best")
    add_json_arg(p)
    args = p.parse_args()
    clock = setup(args)
    cfg = load_config("configs/small_cpu.yaml", ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=8",
                                                 "model.ffn_hidden=1408"])
    B, T = 8, 64
    model = build_model(cfg.model, seed=0)
    x = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m = model.memory_norm(model.encode(model.embed(x)))
    e = model.embed(x).detach().requires_grad_(True)
    m = m.requires_grad_(True)

    def step():
        model.decode_dense(e, model.memory_kv(m)).sum().backward()

    times = {}
    times["eager fused (oneDNN products)"], _ = best_of_rounds({"x": step}, args.repeats, clock)
    fused.MKLDNN_MIN_ELEMENTS = 1 << 62
    fused_state.Slab.allocate = separate_buffers
    model.decoder = Decoder(static=True)
    times["capture-ready, plain mm, uncompiled"], _ = best_of_rounds({"x": step}, args.repeats, clock)
    body = cuda_graphs._Body.__init__

    def compiled_body(self, fn, capture, pool=None):
        body(self, torch.compile(fn, dynamic=False), capture, pool)

    cuda_graphs._Body.__init__ = compiled_body
    model.decoder = cuda_graphs.GraphedDecoder()  # the captured run (parallel/cuda_graphs.py), its bodies compiled
    t0 = time.time()
    step()  # compiles
    compile_s = time.time() - t0
    times["capture-ready, plain mm, compiled"], _ = best_of_rounds({"x": step}, args.repeats, clock)
    res = Results("compiled_step", args)
    report(res, {label: t["x"] for label, t in times.items()}, compile_s,
           f"d=512 H=8 ffn=1408 L={cfg.model.n_layers}, B={B}, T={T}; {describe(args)}")
    res.write()


if __name__ == "__main__":
    main()
