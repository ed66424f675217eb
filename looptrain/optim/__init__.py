"""Optimizers: the factory (names, groups, 8-bit with 32-bit embeddings, Adafactor), the step fused into backward.

Modules:
    factory       `build_optimizer`, the optimizer names and which options each takes
    adafactor     `Adafactor`: Hugging Face's, its step in place (bitwise the same, one temporary less)
    per_parameter `PerParameterOptimizer`: one optimizer per parameter, built from an ordinary one
    in_backward   `OptimizerInBackward`: each parameter steps inside backward, clipping kept
    bf16          bf16 weights: `BF16Optimizer`, `stochastic_round_`, `cast_to_bf16`
    state_bytes   `optimizer_state_bytes`: bytes of any optimizer's state
    clipping      `clip_gradients`: every optimizer the Loop steps clipped by one call (wrappers clip their own)
    wrap          `wrap_for_config`: the optimizer a run steps, for its `LoopConfig` (fused step, bf16 weights)
"""

from looptrain.optim.bf16 import (
    BF16Optimizer,
    cast_to_bf16,
    gradient_of,
    step_in_fp32_,
    stochastic_round_,
    stored_in_bf16,
)
from looptrain.optim.clipping import clip_gradients, clip_parameters_
from looptrain.optim.factory import (
    EIGHT_BIT_OPTIMIZERS,
    FOREACH_OPTIMIZERS,
    OPTIMIZER_NAMES,
    build_optimizer,
    build_parameter_groups,
    optimizer_name_of,
    optimizer_options_problem,
    private_override_manager,
    register_embedding_state_bits,
)
from looptrain.optim.in_backward import CLIP_MODES, OptimizerInBackward
from looptrain.optim.per_parameter import PerParameterOptimizer
from looptrain.optim.state_bytes import inner_optimizers, optimizer_state_bytes
from looptrain.optim.wrap import wrap_for_config

__all__ = [
    "BF16Optimizer",
    "PerParameterOptimizer",
    "cast_to_bf16",
    "stored_in_bf16",
    "gradient_of",
    "step_in_fp32_",
    "stochastic_round_",
    "CLIP_MODES",
    "EIGHT_BIT_OPTIMIZERS",
    "FOREACH_OPTIMIZERS",
    "OPTIMIZER_NAMES",
    "OptimizerInBackward",
    "build_optimizer",
    "build_parameter_groups",
    "clip_gradients",
    "clip_parameters_",
    "inner_optimizers",
    "optimizer_name_of",
    "optimizer_options_problem",
    "optimizer_state_bytes",
    "private_override_manager",
    "register_embedding_state_bits",
    "wrap_for_config",
]
