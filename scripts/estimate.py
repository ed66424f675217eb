#!/usr/bin/env python
"""Estimate the peak memory of a training step for any model shape and strategy mix, without a GPU.

    python scripts/estimate.py --preset bert-large --batch-size 32 --seq-len 128 --ladder
    python scripts/estimate.py --model path/to/model --batch-size 8 --seq-len 256 --optim adamw8bit --grad-checkpoint

The same command line as `python -m looptrain.memory` (see docs/memory.md).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from looptrain.cli.estimate import main

    sys.exit(main())
