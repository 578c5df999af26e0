"""`rlt-mega inspect` as a script: python tools/inspect_ckpt.py --help (see rlt_mega/checkpoint_tools/commands.py)."""

import sys

from rlt_mega.checkpoint_tools.commands import main

if __name__ == "__main__":
    sys.exit(main("inspect"))
