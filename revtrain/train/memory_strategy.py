"""Choose the memory mode of every reversible block before training: one mode for all,
a saved plan, or a plan made now for a memory budget (Jiang et al. 2021, stages 1-3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from revtrain.core import set_modes
from revtrain.planner import Plan, plan_for_model
from revtrain.planner.setup import LossFn
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
    loss_fn: LossFn = F.cross_entropy,
) -> Plan | None:
    """Set every block's mode as ``config`` says; returns the plan applied, or None.

    ``config.plan`` loads a plan; ``config.budget`` profiles ``first_batch()`` with ``loss_fn``
    (the run's task's loss; default cross-entropy), solves a plan and measures its real step
    (the model's weights, statistics, grads and the random generators are left as they were, so
    planning does not change the run's results); otherwise all blocks get ``config.mode``. A
    plan is also written to ``run_dir/plan.json``, and its summary (predicted and, when planned
    now, measured step time and peak) goes to ``log``.
    """
    if config.plan is not None:
        if not Path(config.plan).is_file():
            raise ConfigError(f"plan file {config.plan} does not exist; make one with `revtrain plan` "
                              "or set modes with --mode M|C")
        plan = Plan.from_json(config.plan)
        if plan.batch_size is not None and plan.batch_size != config.batch_size:
            log(f"warning: the plan was solved for batch size {plan.batch_size} and this run uses "
                f"{config.batch_size}; its memory prediction does not hold (plan again at this size)")
    elif config.budget is not None:
        plan = _plan_for_budget(model, config, first_batch(), device, loss_fn)
    else:
        set_modes(model, config.mode)
        return None
    plan.apply(model)
    plan.to_json(run_dir / "plan.json")
    log(plan.summary())
    return plan


def _plan_for_budget(model: nn.Module, config: TrainConfig, batch: Batch, device: torch.device,
                     loss_fn: LossFn) -> Plan:
    # The optimizer's state counts in the peak: plan with the run's own optimizer.
    make_optimizer = optimizer_factory(config)
    # plan_for_model leaves the model (weights, statistics, grads, modes) and the random
    # generators as they were, so planning does not change the run's results.
    return plan_for_model(model, batch, config.budget, loss_fn=loss_fn, make_optimizer=make_optimizer,
                          device=device, model_name=config.model, measure=True)
