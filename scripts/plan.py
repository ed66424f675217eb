#!/usr/bin/env python
"""Plan only, train nothing: a shim over `looptrain.cli.plan` (docs/plan.md).

    python scripts/plan.py --model DIR --data train.csv --memory-budget 4GiB [--json]   # or `looptrain-plan`
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from looptrain.cli.plan import main_entry

    main_entry()
