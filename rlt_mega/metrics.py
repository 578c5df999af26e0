"""Metrics: TensorBoard scalars plus a ``metrics.jsonl`` beside them (one JSON object per
logged step, for scripts and tests), written by rank 0 only; and phase timers."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from rlt_mega.log import get_logger

log = get_logger(__name__)


class Metrics:
    def __init__(self, log_dir: str | Path, enabled: bool = True) -> None:
        self.log_dir, self.enabled = Path(log_dir), enabled
        self._writer = None
        self._jsonl = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: slow import

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.log_dir))
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        for key, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(key, value, step)
        clean = {k: (v if v is None or math.isfinite(v) else str(v)) for k, v in scalars.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        if self.enabled:
            self._writer.close()
            self._jsonl.close()


def read_metrics(log_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (for tests, sweeps and notebooks)."""
    path = Path(log_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Timers:
    """Wall time per named phase: ``with timers("generate"): ...``; ``pop()`` returns and resets."""

    def __init__(self, sync: Optional[callable] = None) -> None:
        self._total: dict[str, float] = defaultdict(float)
        self._sync = sync  # e.g. torch.cuda.synchronize, so GPU work is attributed to its phase

    @contextmanager
    def __call__(self, name: str):
        if self._sync:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                self._sync()
            self._total[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self._total.items()}
        self._total.clear()
        return out
