#!/usr/bin/env python
"""Draw a run's report.png: a shim over `looptrain.cli.report` (docs/report.md).

    python scripts/report.py runs/exp1   # or `looptrain-report runs/exp1`
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from looptrain.cli.report import main

    sys.exit(main())
