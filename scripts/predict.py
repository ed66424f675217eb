#!/usr/bin/env python
"""Predict (and evaluate) with a fine-tuned model: a shim over `looptrain.cli.predict` (docs/predict.md).

    python scripts/predict.py --model runs/x/final --data test.csv --output predictions.jsonl   # or `looptrain-predict`
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from looptrain.cli.predict import main

    sys.exit(main())
