"""looptrain: a memory-lean, hand-written PyTorch training loop for transformer fine-tuning.

The loop is `Loop` + `LoopConfig`; a run's memory/speed strategy is described once, by `Strategy`
(whose loop levers `LoopConfig` inherits); the strategies' implementations live in small modules: `looptrain.freeze`,
`looptrain.gradient_checkpointing`, `looptrain.optim`, `looptrain.data`, `looptrain.memory`,
`looptrain.metrics`, `looptrain.checkpoint`. Above the Loop, `looptrain.planning` holds the estimator
(`estimate`) and the planner (`plan`).
"""

from looptrain.checkpoint import CheckpointError
from looptrain.config import ConfigError, LoopConfig
from looptrain.data import (
    DataError,
    DynamicPaddingCollator,
    LengthGroupedSampler,
    TokenBudgetBatchSampler,
    make_eval_loader,
    make_train_loader,
    read_classification_data,
    read_lm_data,
    tokenize,
    tokenize_lm,
)
from looptrain.estimation import estimate
from looptrain.freeze import (
    freeze_by_pattern,
    freeze_embeddings,
    freeze_encoder,
    freeze_layers,
    freeze_report,
    trainable_parameters,
)
from looptrain.gradient_checkpointing import disable_gradient_checkpointing, enable_gradient_checkpointing
from looptrain.guards import TrainingDiverged
from looptrain.ledger import LedgerError
from looptrain.loop import EvaluationError, Loop
from looptrain.metrics import EvalMetrics
from looptrain.optim import build_optimizer, optimizer_state_bytes
from looptrain.planning import PlanError, plan
from looptrain.report import run_series, write_report
from looptrain.seeding import seed_everything
from looptrain.strategy import Strategy

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DynamicPaddingCollator",
    "EvalMetrics",
    "EvaluationError",
    "LedgerError",
    "LengthGroupedSampler",
    "Loop",
    "LoopConfig",
    "PlanError",
    "Strategy",
    "TokenBudgetBatchSampler",
    "TrainingDiverged",
    "build_optimizer",
    "disable_gradient_checkpointing",
    "enable_gradient_checkpointing",
    "estimate",
    "freeze_by_pattern",
    "freeze_embeddings",
    "freeze_encoder",
    "freeze_layers",
    "freeze_report",
    "make_eval_loader",
    "make_train_loader",
    "optimizer_state_bytes",
    "plan",
    "read_classification_data",
    "read_lm_data",
    "run_series",
    "seed_everything",
    "tokenize",
    "tokenize_lm",
    "trainable_parameters",
    "write_report",
]
__version__ = "0.1.0"
