"""`python -m torch_commopt ...`: the command line (torch_commopt/cli.py)."""

import sys

from torch_commopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
