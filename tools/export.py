"""`rlt-mega export` as a script: python tools/export.py --help (see rlt_mega/checkpoint_tools/commands.py)."""

import sys

from rlt_mega.checkpoint_tools.commands import main

if __name__ == "__main__":
    sys.exit(main("export"))
