"""`python -m looptrain.report RUN_DIR`: the picture's command line, which lives in `looptrain.cli.report`."""

import sys

from looptrain.cli.report import main

if __name__ == "__main__":
    sys.exit(main())
