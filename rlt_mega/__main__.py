import sys

from rlt_mega.cli import main

sys.exit(main())
