"""`python -m looptrain.memory`: the estimate's command line, which lives in `looptrain.cli.estimate`."""

import sys

from looptrain.cli.estimate import main

if __name__ == "__main__":
    sys.exit(main())
