"""Pretraining data benchmarks (a measurement, not a test: it asserts nothing), side by side in
one run on one generated corpus:

- preprocess throughput: ``rlt-mega preprocess`` with 1 and with 2 workers (MB of corpus per
  second of the whole command, and the throughput line the command prints itself);
- training start-up: process start to the first optimizer step of ``rlt-mega pretrain`` on
  the same corpus, from the indexed dataset against the in-memory path (which reads,
  tokenizes and packs the corpus at start-up);
- the peak resident set size of each command (its largest process: ``wait4``'s ru_maxrss).

    PYTHONPATH=. python tools/bench/data.py                  # a 200 MB corpus, byte tokenizer
    PYTHONPATH=. python tools/bench/data.py --mb 20 --tokenizer path/to/tokenizer.json
    PYTHONPATH=. python tools/bench/data.py --only startup --repeats 3

Each command is a fresh process (its imports included), timed by the wall clock: start-up is
elapsed time by definition, and the workers run in parallel. On a shared machine neighbours
slow every contestant; ``--repeats`` runs interleaved rounds and keeps each figure's best.
The corpus, the datasets and the HF datasets cache of the in-memory runs live in one
``mktemp -d`` directory, deleted at the end (only that directory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PYTHON = [sys.executable, "-m", "rlt_mega"]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A jsonl corpus of ``megabytes`` MB: documents of 100 to 1500 words (~5 KB, about a
    fineweb-edu document) drawn from 5000 pseudo-words (Zipf-like frequencies). Returns the
    number of documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(5000)]
    freq = 1.0 / np.arange(1, len(words) + 1)
    freq /= freq.sum()
    target, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w") as f:
        while written < target:
            ids = rng.choice(len(words), size=int(rng.integers(100, 1500)), p=freq)
            line = json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def run(cmd: list[str], env: dict, first_step_log: Path | None = None) -> tuple[float, float, float, int, str]:
    """-> (seconds to exit, seconds to the first logged step (or to exit), CPU seconds of the
    command and the workers it waited for, peak RSS bytes of its largest process, output)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        first = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if first is None and first_step_log is not None and first_step_log.is_file() \
                    and '"step": 1' in first_step_log.read_text():
                first = time.perf_counter() - start
            if pid:
                break
            time.sleep(0.02)
        total = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{text[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return total, first if first is not None else total, cpu, usage.ru_maxrss * 1024, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=200.0, help="corpus size in MB (default 200)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json (default byte)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds; each figure is the best")
    parser.add_argument("--config", default="configs/tiny_cpu.yaml", help="the model trained at start-up")
    parser.add_argument("--only", choices=["preprocess", "startup"], help="one section (startup still preprocesses "
                        "the corpus once, unmeasured)")
    harness.add_json_arg(parser)
    args = parser.parse_args()
    res = harness.Results("data", args)
    work = Path(tempfile.mkdtemp(prefix="rlt_bench_data_"))
    try:
        bench(args, work, res)
    finally:
        shutil.rmtree(work)  # only the directory this run made
    res.write()


def bench(args, work: Path, res: harness.Results) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore",
               HF_DATASETS_CACHE=str(work / "hf_cache"), RLT_LOG_LEVEL="WARNING")
    corpus, eval_file = work / "corpus.jsonl", work / "eval.jsonl"
    t0 = time.perf_counter()
    docs = generate_corpus(corpus, args.mb)
    generate_corpus(eval_file, 0.2, seed=1)
    size_mb = corpus.stat().st_size / 1e6
    print(f"# data benchmark: {size_mb:.1f} MB jsonl corpus ({docs:,} documents, generated in "
          f"{time.perf_counter() - t0:.0f} s), tokenizer {args.tokenizer}, {os.cpu_count()} CPU(s), "
          f"load average {os.getloadavg()[0]:.1f} at the start (a shared machine slows every figure)")
    if args.only != "startup":
        section_preprocess(args, work, env, corpus, size_mb, res)
    else:
        run([*PYTHON, "preprocess", "--data", str(corpus), "--tokenizer", args.tokenizer, "--out",
             str(work / "corpus_w1"), "--workers", "2", "--no-progress"], env)
    if args.only != "preprocess":
        section_startup(args, work, env, corpus, eval_file, res)


def section_preprocess(args, work: Path, env: dict, corpus: Path, size_mb: float, res: harness.Results) -> None:
    pre = {1: [], 2: []}
    for _ in range(args.repeats):
        for workers in (1, 2):
            prefix = work / f"corpus_w{workers}"
            total, _, cpu, rss, out = run([*PYTHON, "preprocess", "--data", str(corpus), "--tokenizer",
                                           args.tokenizer, "--out", str(prefix), "--workers", str(workers),
                                           "--overwrite", "--no-progress"], env)
            own = re.search(r"throughput: .*", out)
            busiest = float(re.search(r"the busiest process ([0-9.]+) s", out).group(1))
            pre[workers].append((total, cpu, busiest, rss, own.group(0) if own else "?"))
    report_preprocess(res, pre, size_mb)


def report_preprocess(res: harness.Results, pre: dict[int, list[tuple]], size_mb: float) -> None:
    """Prints and records the preprocess rounds (workers -> [(seconds, CPU s, busiest process's CPU s,
    peak RSS bytes, the command's own throughput line)]) of a ``size_mb`` MB corpus."""
    print("\n## preprocess: rlt-mega preprocess, the whole command (start-up included); CPU s: the command and "
          "its workers")
    print(f"{'workers':>7} {'seconds':>8} {'MB/s':>7} {'CPU s':>7} {'busiest':>8} {'MB/s*':>7} {'peak RSS MiB':>13}"
          "  the command's own line (wall clock, after its imports)")
    best, busiest = {}, {}
    for workers, rounds in pre.items():
        total, cpu, busy, rss, own = min(rounds)
        best[workers], busiest[workers] = total, min(r[2] for r in rounds)
        print(f"{workers:>7} {total:>8.1f} {size_mb / total:>7.2f} {cpu:>7.1f} {busiest[workers]:>8.1f} "
              f"{size_mb / busiest[workers]:>7.2f} {rss / 2**20:>13.0f}  {own}")
        res.row(f"rlt-mega preprocess, {size_mb:.1f} MB corpus, the whole command", workers=workers, seconds=round(total, 1),
                **{"MB/s": round(size_mb / total, 2), "CPU s": round(cpu, 1), "busiest CPU s": round(busiest[workers], 1),
                   "MB/s per busiest s": round(size_mb / busiest[workers], 2), "peak RSS MiB": round(rss / 2**20)})
    print("  (CPU s: the command and its workers; busiest: the CPU seconds of its busiest process, about its wall "
          "time with a free core per process; MB/s*: MB per busiest-process second)")
    print(f"ratio: 2 workers are {best[1] / best[2]:.2f}x as fast as 1 by the wall clock (load average now "
          f"{os.getloadavg()[0]:.1f}), {busiest[1] / busiest[2]:.2f}x by the busiest process's CPU time")


def section_startup(args, work: Path, env: dict, corpus: Path, eval_file: Path, res: harness.Results) -> None:
    common = ["pretrain", "--config", args.config, f"data.tokenizer={args.tokenizer}", f"data.eval={eval_file}",
              "train.steps=1", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
              "logging.progress=false"]
    paths = {"in memory": str(corpus), "indexed": str(work / "corpus_w1")}  # (the preprocess section wrote it)
    start = {k: [] for k in paths}
    for r in range(args.repeats):
        for label, train in paths.items():
            shutil.rmtree(work / "hf_cache", ignore_errors=True)  # a cold start, as a new job's
            tb = work / f"tb_{label.replace(' ', '_')}_{r}"
            ckpt = work / "ckpt" / label.replace(" ", "_") / str(r)
            total, first, _, rss, _ = run([*PYTHON, *common, f"data.train={train}", f"logging.dir={tb}",
                                           f"checkpoint.dir={ckpt}"], env, first_step_log=tb / "metrics.jsonl")
            start[label].append((first, rss))
    report_startup(res, start, args.config)


def report_startup(res: harness.Results, start: dict[str, list[tuple]], config: str) -> None:
    """Prints and records the start-up rounds (data path -> [(seconds to the first step, peak RSS bytes)])."""
    print(f"\n## training start-up: rlt-mega pretrain ({config}), process start to the first step")
    print(f"{'data path':<10} {'seconds':>8} {'peak RSS MiB':>13}")
    for label, rounds in start.items():
        first, rss = min(rounds)
        print(f"{label:<10} {first:>8.1f} {rss / 2**20:>13.0f}")
        res.row(f"rlt-mega pretrain ({config}), process start to the first step", **{
            "data path": label, "seconds": round(first, 1), "peak RSS MiB": round(rss / 2**20)})
    (mem_s, mem_rss), (idx_s, idx_rss) = min(start["in memory"]), min(start["indexed"])
    print(f"ratio: the indexed start is {mem_s / idx_s:.1f}x as fast, with {mem_rss / idx_rss:.1f}x less peak RSS "
          f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
