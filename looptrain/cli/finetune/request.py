"""The command line parsed once: a frozen `RunRequest` that every step of a run reads and none writes.

`request_of` checks the parsed flags (`arguments.check_flags`), resolves the defaults that depend on other flags
(the metric for the task, the accumulation of ``--effective-batch``), and returns the request: the flags (`Flags`,
read-only), the process it runs in (`Process`), the memory budget (`BudgetRequest`) and, for a resumed planned run,
the plan it saved. The planner's answer is a new request (`RunRequest.planned`), never a change to this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from looptrain.cli.errors import UsageError
from looptrain.cli.finetune.arguments import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_METRIC_FOR_BEST,
    budget_bytes,
    check_flags,
    run_recipe,
    strategy_of,
)

if TYPE_CHECKING:
    from looptrain.config import LoopConfig


@dataclass(frozen=True)
class Flags:
    """Every flag's value by its argparse dest, read-only: ``flags.max_length``; and ``flags.adapter``: a LoRA adapter
    --model resolved (``{"path", "base"}``, its levers set as the --lora flags), else None.

    The functions that read flags take a `Flags` (or, from Python, the `argparse.Namespace` of `build_parser`).
    """

    values: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(f"no flag with dest {name!r}") from None

    def replace(self, **changes: Any) -> Flags:
        """These flags with `changes`, as if they had been given."""
        return Flags(types.MappingProxyType({**self.values, **changes}))

    def to_dict(self) -> dict:
        return dict(self.values)


@dataclass(frozen=True)
class Process:
    """The process a run happens in.

    Args:
        argv: the command line as given, a --config file's flags written out in front of it (`expand_config`).
        owns_process: the process is this run's alone (the console script's), so settings that outlive the run
            may be changed (glibc's malloc thresholds, under a budget read as RSS).
        rss_at_start: the process's RSS once the libraries are imported (None: not Linux).
        capped_kernel_caches: what capping oneDNN's kernel caches said (a budget in a process of its own), said by
            `run` once it knows where its messages go.
    """

    argv: tuple[str, ...] = ()
    owns_process: bool = False
    rss_at_start: int | None = None
    capped_kernel_caches: str | None = None

    @property
    def given(self) -> frozenset[str]:
        """The flags on the command line (``--name`` of ``--name=value`` too)."""
        return frozenset(token.split("=")[0] for token in self.argv)


@dataclass(frozen=True)
class BudgetRequest:
    """`--memory-budget` and the planner's flags."""

    size: str  # as given: 4GiB
    bytes: int
    meter: str  # --budget-meter: auto, rss or tensors
    plan_time: float | None
    plan_only: bool
    json: bool


@dataclass(frozen=True)
class RunRequest:
    """One run of the command line, as asked: the flags, the process, the budget, a resumed plan; once the run
    knows them, the model's path and the loop's configuration (`dataclasses.replace`: a new request)."""

    flags: Flags
    process: Process
    budget: BudgetRequest | None = None
    resumed_plan: dict | None = None  # a resumed planned run: the plan its run_config.json saved
    model_path: str | None = None  # --model, or the embedded model's directory, once the run resolved it
    config: LoopConfig | None = None  # once the run knows its identity (its model, data and world size)

    @property
    def strategy(self) -> Any:
        """The `looptrain.Strategy` of the flags (--optim auto stands for adamw until the planner chooses)."""
        return strategy_of(self.flags)

    def planned(self, settings: Any, *, resumed_plan: dict | None = None) -> RunRequest:
        """The request that trains `settings` (a plan's winner, or a resumed run's saved plan): its levers as if
        their flags had been given, --amp resolved by the plan."""
        from looptrain import strategy

        levers = {spec.name: getattr(settings, spec.name) for spec in strategy.levers(type(settings))}
        config = dataclasses.replace(self.config, **settings.loop_fields()) if self.config is not None else None
        return dataclasses.replace(self, flags=self.flags.replace(**levers, amp=False), config=config,
                                   resumed_plan=resumed_plan if resumed_plan is not None else self.resumed_plan)

    def recipe(self) -> dict:
        """The --config recipe that trains this request again (OUTPUT_DIR/config.yaml, --save-config)."""
        return run_recipe(self.flags)

    def arguments(self) -> dict:
        """run_config.json's "arguments": every flag's value (and the budget in bytes, with --memory-budget)."""
        extra = {"memory_budget_bytes": self.budget.bytes} if self.budget is not None else {}
        return {**self.flags.to_dict(), **extra}


def request_of(arguments: argparse.Namespace, process: Process) -> RunRequest:
    """The request of parsed flags: checked (a `UsageError` names the flags that cannot go together), with the
    defaults that depend on other flags resolved: an adapter --model's LoRA levers, --max-length by task."""
    arguments = argparse.Namespace(**vars(arguments))  # resolved here; the caller's namespace stays as parsed
    arguments.adapter = adapter_of(arguments, process.given)
    if arguments.max_length is None:
        arguments.max_length = default_max_length(arguments)
    check_flags(arguments, process.given)
    values = dict(vars(arguments))
    if values["metric_for_best"] is None:
        values["metric_for_best"] = DEFAULT_METRIC_FOR_BEST[values["task"]]
    if values["effective_batch"] is not None and values["memory_budget"] is None:
        values["accum_steps"] = values["effective_batch"] // values["batch_size"]
    flags = Flags(types.MappingProxyType(values))
    return RunRequest(flags=flags, process=process, budget=budget_of(flags))


def budget_of(flags: Flags) -> BudgetRequest | None:
    """`--memory-budget` read (a `UsageError` for a size that is not one), or None without it."""
    if flags.memory_budget is None:
        return None
    return BudgetRequest(size=flags.memory_budget, bytes=budget_bytes(flags.memory_budget), meter=flags.budget_meter,
                         plan_time=flags.plan_time, plan_only=flags.plan_only, json=flags.json)


def adapter_of(arguments: argparse.Namespace, given) -> dict | None:
    """A LoRA adapter --model (a --lora run's final/), to continue training: its base resolved (--base-model, else
    the one it records) and its own rank, alpha, dropout and targets set as the --lora flags' values; None for a
    model. A UsageError for --lora flags beside it, or a --task that is not the adapter's."""
    from looptrain.cli.adapters import adapter_kind, adapter_levers, check_no_lora_flags, read_adapter

    adapter = read_adapter(arguments.model, arguments.base_model)
    if adapter is None:
        return None
    check_no_lora_flags(arguments.model, given)
    task = {"causal_lm": "causal-lm", "classifier": "sequence-classification"}[adapter_kind(adapter, arguments.model)]
    if arguments.task != task:
        raise UsageError(f"--model {arguments.model} holds LoRA adapters of a {task.replace('-', ' ')} model; pass "
                         f"--task {task}")
    vars(arguments).update(adapter_levers(adapter, arguments.model))
    return {"path": arguments.model, "base": adapter["base"]}


def default_max_length(arguments: argparse.Namespace) -> int:
    """--max-length's default: the task's (`DEFAULT_MAX_LENGTH`), at most a causal LM's positions."""
    default = DEFAULT_MAX_LENGTH[arguments.task]
    if arguments.task != "causal-lm" or arguments.model is None:
        return default
    from looptrain.cli.finetune.inputs import read_model_config

    model = arguments.adapter["base"] if arguments.adapter else arguments.model
    positions = getattr(read_model_config(model, arguments.trust_remote_code), "max_position_embeddings", None)
    return min(default, positions) if isinstance(positions, int) and positions > 0 else default
