import os
import sys
from pathlib import Path

import torch

# tests/ on the path for the reference implementation; one thread per test process keeps the
# suite predictable on a 2-core machine.
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(int(os.environ.get("RLT_TEST_THREADS", "1")))
os.chdir(Path(__file__).resolve().parent.parent)  # configs/ paths relative to the repo root
# The suite runs with deterministic kernels on (train.deterministic's default, warn_only=False),
# so an op we run that has no deterministic CPU kernel fails a test instead of going unnoticed.
torch.use_deterministic_algorithms(True)
