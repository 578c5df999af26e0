"""One rank-aware logger for the whole package: rank 0 logs at the configured level, other
ranks only warnings and errors (each line prefixed with its rank), so a 64-rank job does not
print every message 64 times. Library code logs through ``get_logger(__name__)``."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def _rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                pass
    return 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return record.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(level: str = "INFO") -> None:
    """Configures the ``rlt_mega`` logger once (idempotent; the level can be changed later)."""
    global _CONFIGURED
    logger = logging.getLogger("rlt_mega")
    logger.setLevel(level.upper())
    if _CONFIGURED:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("[%(asctime)s rank%(rank)s %(levelname)s] %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    _CONFIGURED = True


def get_logger(name: str) -> logging.Logger:
    if not _CONFIGURED:
        setup_logging(os.environ.get("RLT_LOG_LEVEL", "INFO"))
    return logging.getLogger(name if name.startswith("rlt_mega") else f"rlt_mega.{name}")
