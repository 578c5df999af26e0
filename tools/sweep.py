"""Grid sweeps of short training runs: python tools/sweep.py configs/sweeps/cpu_c_by_l.yaml
(see rlt_mega/cost/sweep.py for the YAML format; --dry-run prints the commands)."""

import sys

from rlt_mega.cost.sweep import main

if __name__ == "__main__":
    sys.exit(main())
