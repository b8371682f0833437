"""Choose the memory mode of every reversible block before training: one mode for all,
a saved plan, or a plan made now for a memory budget (Jiang et al. 2021, stages 1-3).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from revtrain.core import reversible_blocks, set_modes
from revtrain.models import input_spec
from revtrain.planner import Plan, plan_for_model
from revtrain.planner.setup import LossFn
from revtrain.tasks import get_task, task_for
from revtrain.train.optim import optimizer_factory
from revtrain.train.config import ConfigError, TrainConfig

__all__ = ["apply_memory_strategy"]

Batch = tuple[torch.Tensor, torch.Tensor]


def apply_memory_strategy(
    model: nn.Module,
    config: TrainConfig,
    *,
    first_batch: Callable[[], Batch],
    device: torch.device,
    run_dir: Path,
    log: Callable[[str], None] = print,
    loss_fn: LossFn | None = None,
) -> Plan | None:
    """Set every block's mode as ``config`` says; returns the plan applied, or None.

    ``config.plan`` loads a plan (and warns when it was solved for another batch size or sample
    shape, e.g. another sequence length, than ``first_batch()``'s); ``config.budget`` profiles
    ``first_batch()`` with ``loss_fn`` (the run's task's loss; default the loss of the task that
    trains ``config.model``: cross-entropy over classes or over tokens), solves a plan and
    measures its real step
    (the model's weights, statistics, grads and the random generators are left as they were, so
    planning does not change the run's results); otherwise all blocks get ``config.mode``. A
    plan is also written to ``run_dir/plan.json``, and its summary (predicted and, when planned
    now, measured step time and peak) goes to ``log``.
    """
    if config.plan is not None:
        if Path(config.plan).is_dir():
            raise ConfigError(f"--plan {config.plan} is a folder; pass the plan file, e.g. "
                              f"{Path(config.plan) / 'plan.json'}")
        if not Path(config.plan).is_file():
            raise ConfigError(f"plan file {config.plan} does not exist; make one with `revtrain plan` "
                              "or set modes with --mode M|C")
        try:
            plan = Plan.from_json(config.plan)
        except ValueError as err:
            raise ConfigError(f"--plan {config.plan}: {err}") from None
        sample_shape = tuple(first_batch()[0].shape[1:])
        mismatch = plan.workload_mismatch(config.batch_size, sample_shape)
        if mismatch is not None:
            log(f"warning: {mismatch}; its memory prediction does not hold (plan again for this run's "
                "batch size and input)")
    elif config.budget is not None:
        plan = _plan_for_budget(model, config, first_batch(), device, loss_fn or _task_loss(config))
    else:
        set_modes(model, config.mode)
        return None
    plan.apply(model)
    plan.to_json(run_dir / "plan.json")
    log(plan.summary())
    return plan


def _plan_for_budget(model: nn.Module, config: TrainConfig, batch: Batch, device: torch.device,
                     loss_fn: LossFn) -> Plan:
    if not reversible_blocks(model):
        raise ConfigError(f"--budget {config.budget}: {config.model} has no reversible blocks, so there is nothing to "
                          "plan; train it without --budget, or pick a reversible model (`revtrain models`)")
    # The optimizer's state counts in the peak: plan with the run's own optimizer.
    make_optimizer = optimizer_factory(config)
    # plan_for_model leaves the model (weights, statistics, grads, modes) and the random
    # generators as they were, so planning does not change the run's results.
    return plan_for_model(model, batch, config.budget, loss_fn=loss_fn, make_optimizer=make_optimizer,
                          device=device, model_name=config.model, measure=True, choices=config.choices,
                          **config.pipeline_options())


def _task_loss(config: TrainConfig) -> LossFn:
    """The loss of the run's task, as the trainer picks it: ``--task``, or the task that trains
    the model's kind of input (a language model's logits ``(B, T, V)`` need the token loss)."""
    return (get_task(config.task) if config.task else task_for(input_spec(config.model))).loss
