"""Grid sweeps of short training runs: python tools/sweep.py configs/sweeps/cpu_c_by_l.yaml
(see rlt_mega/plan/sweep.py for the YAML format; --dry-run prints the commands)."""

import sys

from rlt_mega.plan.sweep import main

if __name__ == "__main__":
    sys.exit(main())
