"""Choose the memory mode of every reversible block before training: one mode for all,
a saved plan, or a plan made now for a memory budget (Jiang et al. 2021, stages 1-3).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from revtrain.core import get_modes, reversible_blocks, set_modes
from revtrain.train.checkpoint import capture_rng_state, restore_rng_state
from revtrain.train.config import ConfigError, TrainConfig

__all__ = ["apply_memory_strategy", "preserved_state"]

Batch = tuple[torch.Tensor, torch.Tensor]


def apply_memory_strategy(
    model: nn.Module,
    config: TrainConfig,
    *,
    first_batch: Callable[[], Batch],
    device: torch.device,
    run_dir: Path,
    log: Callable[[str], None] = print,
) -> Any:
    """Set every block's mode as ``config`` says; returns the plan applied, or None.

    ``config.plan`` loads a plan; ``config.budget`` profiles ``first_batch()`` and solves one
    (the model's weights, statistics, grads and the random generators are restored afterwards,
    so planning does not change the run's results); otherwise all blocks get ``config.mode``.
    A plan is also written to ``run_dir/plan.json``, and its summary goes to ``log``.
    """
    from revtrain.planner import Plan  # the planner imports the profiler; only load it when used

    if config.plan is not None:
        if not Path(config.plan).is_file():
            raise ConfigError(f"plan file {config.plan} does not exist; make one with `revtrain plan` "
                              "or set modes with --mode M|C")
        plan = Plan.from_json(config.plan)
        if plan.batch_size is not None and plan.batch_size != config.batch_size:
            log(f"warning: the plan was solved for batch size {plan.batch_size} and this run uses "
                f"{config.batch_size}; its memory prediction does not hold (plan again at this size)")
    elif config.budget is not None:
        plan = _plan_for_budget(model, config, first_batch(), device)
    else:
        set_modes(model, config.mode)
        return None
    plan.apply(model)
    plan.to_json(run_dir / "plan.json")
    log(plan.summary())
    return plan


def _plan_for_budget(model: nn.Module, config: TrainConfig, batch: Batch, device: torch.device) -> Any:
    import revtrain.planner as planner

    plan_for_model = getattr(planner, "plan_for_model", None)
    if plan_for_model is None:
        raise ConfigError("--budget needs revtrain.planner.plan_for_model, which this revtrain "
                          "does not provide; set modes with --mode M|C or --plan plan.json")
    accepted = inspect.signature(plan_for_model).parameters
    extra: dict[str, Any] = {}
    if "model_name" in accepted:
        extra["model_name"] = config.model
    if "make_optimizer" in accepted:  # the optimizer's state counts in the peak: use the run's
        extra["make_optimizer"] = lambda params: torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
            weight_decay=config.weight_decay,
        )
    x, y = batch[0].to(device), batch[1].to(device)
    with preserved_state(model):
        return plan_for_model(model, (x, y), config.budget, device=device, **extra)


@contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run the body (e.g. profiling), then restore the model's values, grads, modes and RNG."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    modes, flags, rng = get_modes(model), [(m, m.training) for m in model.modules()], capture_rng_state()
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        model.load_state_dict(state)
        for p, g in grads:
            p.grad = g
        if reversible_blocks(model):
            set_modes(model, modes)
        for m, training in flags:
            m.training = training
        restore_rng_state(rng)
