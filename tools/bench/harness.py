"""Measurement helpers shared by the benchmarks in tools/bench (imported as ``harness``: they run as scripts).

This machine is shared: other engineers' jobs take the cores at random moments. Two choices
make the ratios stable there:

- One torch thread per process and the process's CPU time (``time.process_time``) as the
  clock ("cpu"): a process that is descheduled by a neighbour does not accumulate CPU time, so
  the figure is the work done. With two threads on two busy cores, OpenMP barriers wait for a
  descheduled thread and a 5 s rollout takes 23 s (measured). ``--clock wall`` and
  ``--threads 2`` give wall-clock figures for a quiet machine.
- Everything that is compared is timed in interleaved rounds and each figure is the best
  (minimum) over the rounds, so a busy neighbour slows all contestants alike and the minimum
  is the least disturbed run.

Peak memory: the peak resident set size of the process during one call, after the allocator
has returned freed memory (``malloc_trim``) and the kernel's high-water mark was reset
(``/proc/self/clear_refs``), minus the resident size just before the call: what the call
allocates on top of what already lives (weights, optimizer state, inputs). It counts tensor
storages plus allocator overhead; it needs Linux and glibc. glibc's heap does not give back pages
that hold a few live small blocks, so after a decoder (thousands of (B, d) tensors, some kept)
the RSS peak overstates the live memory by hundreds of MiB (measured: 514 MiB RSS against 180
MiB of tensors). ``peak_tensor_bytes`` counts tensors only (torch's CPU allocator as reported
to the profiler): the CPU analogue of ``torch.cuda.max_memory_allocated``, independent of the
allocator, and what activation checkpointing is meant to reduce.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Callable, Hashable

import torch

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def add_json_arg(parser) -> None:
    """--json PATH, for a benchmark that records its results in a :class:`Results`."""
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON, with the machine and the date "
                             "(tools/docs/render_performance.py renders docs/performance.md's tables from them)")


def add_common_args(parser) -> None:
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: stable figures on a shared machine; 0: torch's default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: the process's CPU time (robust to neighbours); wall: elapsed time")


def machine() -> dict:
    """What a figure depends on: the CPU model, its cores, the torch version, the date (UTC)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


class Results:
    """A benchmark's results as tables of rows (column -> value, in column order), written with the
    machine, the command and the arguments to ``--json PATH`` by ``write``; the printed tables
    stay the benchmark's own. ``target`` rows (what, target, measured, verdict) feed the summary
    table of docs/performance.md."""

    def __init__(self, name: str, args) -> None:
        self.name, self.args, self.tables = name, args, {}

    def row(self, table: str, **columns) -> None:
        self.tables.setdefault(table, []).append(columns)

    def target(self, what: str, target: str, measured: str, met: bool) -> None:
        self.row("targets", what=what, target=target, measured=measured, verdict="met" if met else "missed")

    def write(self) -> None:
        if not getattr(self.args, "json", None):
            return
        out = {"bench": self.name, "command": " ".join(["python", *sys.argv]), "machine": machine(),
               "args": {k: v for k, v in vars(self.args).items() if k != "json"}, "tables": self.tables}
        path = Path(self.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"results: {path}")


def setup(args) -> Callable[[], float]:
    """Applies --threads and returns the clock of --clock."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return CLOCKS[args.clock]


def describe(args) -> str:
    return (f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), clock={args.clock} "
            f"({'process CPU time' if args.clock == 'cpu' else 'elapsed time'})")


def timed_rounds(fns: dict[Hashable, Callable[[], object]], repeats: int, clock: Callable[[], float]
                 ) -> tuple[dict[Hashable, list[float]], dict[Hashable, object]]:
    """Times every fn once per round, ``repeats`` rounds, in the given order -> (each one's time
    in every round, last output of each)."""
    times: dict[Hashable, list[float]] = {k: [] for k in fns}
    outs: dict[Hashable, object] = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = clock()
            outs[k] = fn()
            times[k].append(clock() - t0)
    return times, outs


def best_of_rounds(fns: dict[Hashable, Callable[[], object]], repeats: int, clock: Callable[[], float]
                   ) -> tuple[dict[Hashable, float], dict[Hashable, object]]:
    """:func:`timed_rounds` -> (best time of each, last output of each)."""
    times, outs = timed_rounds(fns, repeats, clock)
    return {k: min(v) for k, v in times.items()}, outs


def round_ratios(times: dict[Hashable, list[float]], num: Hashable, den: Hashable) -> list[float]:
    """times[num] / times[den] within each round: neighbours that slow one round slow both."""
    return [a / b for a, b in zip(times[num], times[den])]


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def peak_rss(fn: Callable[[], object]) -> int:
    """Bytes by which the resident set size peaked above its value just before ``fn()``."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - base


def peak_tensor_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of CPU tensor storage allocated by ``fn()`` on top of what lived before it:
    the running total (allocations minus frees, counted from the start of profiling) that
    torch's CPU allocator reports to the profiler. The profiler runs with only the user scope
    recorded, so ops are not (allocations are): ~2x faster than a full profile."""
    from torch._C._profiler import ProfilerActivity, RecordScope, _EventType
    from torch.autograd.profiler import (ProfilerConfig, ProfilerState, _disable_profiler, _enable_profiler,
                                         _ExperimentalConfig, _prepare_profiler)

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities, {RecordScope.USER_SCOPE})
    try:
        fn()
    finally:
        result = _disable_profiler()
    # total_allocated is torch's CPU memory reporter's running total, which is not reset between
    # profiling sessions (a block allocated in one session and freed outside any is never taken
    # off it): measure from its value just before this session's first allocation event.
    events, stack = [], list(result.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.total_allocated, event.extra_fields.alloc_size))
        stack.extend(event.children)
    if not events:
        return 0
    events.sort()
    _, first_total, first_size = events[0]
    base = first_total - first_size
    return max(0, max(total for _, total, _ in events) - base)
