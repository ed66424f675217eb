#!/usr/bin/env python
"""Fine-tune a sequence classifier with looptrain: a shim over `looptrain.cli.finetune` (docs/finetune.md).

    python scripts/finetune.py --amp --accum 32       # the same command is installed as `looptrain-finetune`
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from looptrain.cli.finetune import main_entry

    main_entry()
