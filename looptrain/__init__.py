"""looptrain: a memory-lean, hand-written PyTorch training loop for transformer fine-tuning."""

__version__ = "0.1.0"
