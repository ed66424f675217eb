"""looptrain: a memory-lean, hand-written PyTorch training loop for transformer fine-tuning."""

from looptrain.config import ConfigError, LoopConfig
from looptrain.loop import Loop
from looptrain.seeding import seed_everything

__all__ = ["ConfigError", "Loop", "LoopConfig", "seed_everything"]
__version__ = "0.1.0"
