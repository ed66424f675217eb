"""The estimate's fake tensors: the fake model, the fake mode's care, and the Loop's behaviour where values are read.

`fake_model` builds the model on fake tensors (`FakeTensorMode`: shapes and dtypes, no storage, no compute)
and `fake_tensors` turns what peft adds to it into fakes of the same mode (`one_fake_mode` keeps every fake
in that one mode). Fake tensors have shapes but no values, so the two checks of a gradient's finiteness
cannot be read: the estimator brings its own objects through the Loop's doors, `FakePrecision`
(``make_precision``) and `FakeOptimizerInBackward` (through ``wrap_optimizer``, `wrap_optimizer_on_fakes`):
every update steps, since its memory is what is measured. `priming_loss` is the first update's loss
(``run_update(compute_loss=)``), `whole_rows` keeps a causal LM's rows whole on fake positions, and
`price_4bit_storage` makes the tracker see QLoRA's stored base and its dequantized weight.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from looptrain.estimation.blocks import truncate_in_copy, truncated_config
from looptrain.estimation.shapes import is_causal_lm_config, named_config
from looptrain.fake import is_fake
from looptrain.lora import fake_params4bit, quant_state_tensors
from looptrain.memory.kernels import cpu_bf16_matmul_scratch
from looptrain.memory.tracker import CATEGORY_PARAMS
from looptrain.optim import OptimizerInBackward, wrap_for_config
from looptrain.optim.in_backward import row_stepper
from looptrain.precision import Precision


def fake_model(model_or_config: Any, num_labels: int, fake_mode, depth: int | None = None) -> nn.Module:
    """A copy of the model whose parameters and buffers are fake CPU tensors (no real memory); a QLoRA model's 4-bit
    weights are copied as fakes of the bytes bitsandbytes stores (`_fake_parameter`). `depth`: only the first
    `depth` of its identical blocks (`blocks.truncate_in_copy`, `blocks.truncated_config`)."""
    if isinstance(model_or_config, nn.Module):
        memo: dict[int, Any] = {}
        for parameter in model_or_config.parameters():
            memo[id(parameter)] = _fake_parameter(parameter, fake_mode)
        for buffer in model_or_config.buffers():
            memo[id(buffer)] = _cpu_fake(buffer, fake_mode)
        if depth is not None:
            truncate_in_copy(model_or_config, depth, memo)
        return copy.deepcopy(model_or_config, memo)
    config = model_or_config
    if isinstance(config, str):
        config = named_config(config, num_labels)
    else:
        config = copy.deepcopy(config)
    if depth is not None:
        config = truncated_config(config, depth)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config.num_labels = num_labels
    auto_class = AutoModelForCausalLM if is_causal_lm_config(config) else AutoModelForSequenceClassification
    with fake_mode:
        # The attention implementation is resolved as a real from_config resolves it (sdpa where torch has it).
        return auto_class.from_config(config, trust_remote_code=_is_checkpoint_code(config))


def _fake_parameter(parameter: nn.Parameter, fake_mode) -> nn.Parameter:
    """A fake copy of `parameter`; a 4-bit weight of a model quantized already (QLoRA's bitsandbytes ``Params4bit``,
    a tensor subclass that cannot hold a fake) becomes `fake_params4bit` of the weight it stores: its packed bytes
    and its quantization state priced, its forward run through bitsandbytes' code as for a model quantized on fakes."""
    state = getattr(parameter, "quant_state", None)
    if state is not None:
        return fake_params4bit(state.shape, state.dtype, fake_mode)
    return nn.Parameter(_cpu_fake(parameter, fake_mode), requires_grad=parameter.requires_grad)


def fake_tensors(model: nn.Module, fake_mode) -> None:
    """Replaces the real parameters and buffers of `model` (peft's adapters on a fake base) by fakes, in place;
    a tensor shared by several modules stays one."""
    fakes: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, as_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is None or is_fake(tensor):
                    continue
                if id(tensor) not in fakes:
                    fake = _cpu_fake(tensor, fake_mode)
                    fakes[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) if as_parameter \
                        else fake
                table[name] = fakes[id(tensor)]


def _cpu_fake(tensor: torch.Tensor, fake_mode) -> torch.Tensor:
    """A fake CPU tensor of `tensor`'s shape, strides and dtype. The estimate always runs on the CPU (a CUDA run's
    kernels are priced there, `estimate(device=)`): a model on a GPU (or on the meta device) is copied as CPU fakes,
    which the estimate's CPU Loop then keeps where they are."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return fake_mode.from_tensor(tensor)
    with fake_mode:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="cpu")


def _is_checkpoint_code(config: Any) -> bool:
    """Whether `config`'s class is a checkpoint's own code (transformers imports it as ``transformers_modules``,
    only under ``trust_remote_code=True``): its model class, from the same files, may then run. For any other
    config the model is built without running shipped code, and transformers never asks "run the custom code?"."""
    return type(config).__module__.startswith("transformers_modules.")


def vocab_size(model: nn.Module) -> int:
    """The vocabulary a model takes token ids from: its config's, else its first `nn.Embedding`'s."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    if not embeddings:
        raise ValueError("the model has no nn.Embedding and no config.vocab_size: estimate/measure feed token ids.")
    return embeddings[0].num_embeddings


def parameter_numel(parameter: torch.Tensor) -> int:
    """A parameter's elements; a 4-bit weight's are those of the weight it stores (two per uint8 of storage)."""
    state = getattr(parameter, "quant_state", None)
    return int(torch.Size(state.shape).numel()) if state is not None and state.shape is not None else parameter.numel()


class FakePrecision(Precision):
    """`Precision` on fake tensors: a gradient norm has no value to test, so every update steps."""

    def step(self, optimizer: Any, grad_norm: torch.Tensor) -> bool:
        """Steps the optimizer (and, under fp16, updates the scaler); returns True: the step's memory is measured."""
        optimizer.step()
        if self.scaler.is_enabled():
            self.scaler.update()  # closes the unscale_ of this window (no value to read on fake tensors)
        return True


class FakeOptimizerInBackward(OptimizerInBackward):
    """`OptimizerInBackward` on fake tensors: a norm has no value to test, so every gradient counts as finite."""

    def is_finite(self, value: torch.Tensor) -> bool:
        """True: a fake norm has no value, and the step's memory is what is measured."""
        return True


def wrap_optimizer_on_fakes(model: nn.Module, optimizer: Any, config: Any) -> Any:
    """The Loop's ``wrap_optimizer`` door on fake tensors: `wrap_for_config`, its fused step a
    `FakeOptimizerInBackward`."""
    return wrap_for_config(model, optimizer, config, in_backward=FakeOptimizerInBackward)


def priming_loss(model: nn.Module) -> torch.Tensor:
    """A loss whose backward gives every trainable parameter a gradient (zeros) without the model's forward: the
    Loop's update on it creates the optimizer state, and every hook and wrapper the gradients pass through (the
    fused step, fp32 accumulation, the scaler) runs as in a real update, in fewer fake-tensor ops (docs/memory.md,
    "The first update skips the model"). A parameter the model's forward leaves without a gradient gets state here
    where a run would not give it any: the estimate errs above, never below."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    terms = [parameter.sum() if row_stepper(parameter) is None else _ZeroRowsStep.apply(parameter)
             for parameter in trainable]
    return torch.stack(terms).sum() * 0


class _ZeroRowsStep(torch.autograd.Function):
    """A parameter the fused step takes by rows (``step_by_rows``): `priming_loss`'s backward steps it from
    zero rows, as the run's first update steps it from its rows, so that its gradient never exists whole there
    either."""

    @staticmethod
    def forward(ctx, parameter):
        ctx.save_for_backward(parameter)
        return torch.zeros((), dtype=parameter.dtype, device=parameter.device)

    @staticmethod
    def backward(ctx, grad_output):
        (parameter,) = ctx.saved_tensors
        stepper = row_stepper(parameter)
        if stepper is not None:
            storage = parameter.detach()  # the step swaps the parameter's .data while it runs
            stepper(parameter, lambda rows: torch.zeros_like(storage[rows]), parameter.shape[0])
        return None


@contextlib.contextmanager
def whole_rows():
    """A causal LM's rows are whole sequences, as in the real run: no packed-sequence mask on fake positions.

    Without a KV cache (training with checkpointing) transformers looks for sequences packed into a row by reading
    ``position_ids``; a fake tensor has no values to read, so it would build a ``[rows, 1, seq, seq]`` mask that
    the real run (the model's own ``arange`` positions) never builds. The ops that look still run and are priced.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        result = original(position_ids)
        return None if result is not None and is_fake(position_ids) else result

    with replaced(masking_utils, find_packed_sequence_indices=find_packed_sequence_indices):
        yield


@contextlib.contextmanager
def one_fake_mode():
    """A fake tensor deep-copied in the block (peft copies the head a LoRA model trains, ``modules_to_save``) stays
    in its own fake mode.

    torch's ``Tensor.__deepcopy__`` copies a subclass's ``__dict__``, and a FakeTensor's holds its
    ``FakeTensorMode``: the copy would get a mode of its own, whose converter's storage weak references
    (``StorageWeakRef``, a raw pointer each) are copies of the original's, and both would release them. That double
    release corrupted the heap (a segfault in a later estimate) once the estimate's Loop was freed at once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with replaced(FakeTensorMode, create=True, __deepcopy__=lambda mode, memo: mode):
        yield


@contextlib.contextmanager
def replaced(owner: Any, *, create: bool = False, **attributes: Any):
    """`owner`'s attributes replaced by `attributes` for the block, the originals put back after it
    (`unittest.mock.patch.object`, one per attribute; `create`: an attribute `owner` lacks is added, then removed)."""
    from unittest import mock  # imported here: estimating is the only user, and it imports asyncio

    with contextlib.ExitStack() as stack:
        for name, value in attributes.items():
            stack.enter_context(mock.patch.object(owner, name, value, create=create))
        yield


def price_4bit_storage(tracker: Any, model: nn.Module) -> None:
    """QLoRA: the 4-bit weights' quantization states count as parameters, and the forward's dequantized weight is
    seen.

    A quantization state (absmax, offset, code tables) is stored with its weight but is no parameter or buffer.
    On the CPU, bitsandbytes' 4-bit forward (``gemm_4bit``) dequantizes the weight to the compute dtype inside one
    op: a tracker on a real run never sees that transient (only RSS does); the estimate runs bitsandbytes' own
    Python kernel of it (the dequantizations, then ``linear``) so that it does.
    """
    states = quant_state_tensors(model)
    if tracker is None or not states:
        return
    tracker.track_all(states, CATEGORY_PARAMS)
    try:
        from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
    except ImportError:  # another bitsandbytes: its fake kernel gives the output alone
        pass
    else:
        tracker.run_python_kernel(torch.ops.bitsandbytes.gemm_4bit.default, _gemm_4bit_default_impl)
    tracker.reset_peak()


# The matmuls oneDNN runs through an fp32 buffer of their whole output where bf16 is emulated
# (`cpu_bf16_matmul_scratch`); a batched matmul (attention's) takes another path that holds no such buffer.
_BUFFERED_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_"})


def matmul_scratch_rule(device_type: str) -> Callable[[Any, list[torch.Tensor]], int] | None:
    """On a CPU whose bf16 matmuls hold an fp32 buffer of their output while they run (measured:
    `cpu_bf16_matmul_scratch`), the rule for `StorageTracker.price_op_scratch` that counts it at each bf16 matmul:
    RSS holds it though no tensor does, and it is largest where a big table's gradient is accumulated (the LM head's,
    `[vocab, hidden]`). None elsewhere (a GPU, native bf16, AVX2). Made before any fake or tracking mode is entered:
    the measurement runs real tensors."""
    per_element = cpu_bf16_matmul_scratch() if device_type == "cpu" else 0
    if not per_element:
        return None

    def scratch(op: Any, outputs: list[torch.Tensor]) -> int:
        if outputs and outputs[0].dtype == torch.bfloat16 and op._schema.name in _BUFFERED_MATMULS:
            return outputs[0].numel() * per_element
        return 0

    return scratch
