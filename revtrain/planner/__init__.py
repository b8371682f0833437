"""The planner: choose per reversible block between M-mode (memory) and C-mode (speed).

Stages (Jiang et al. 2021, §3.3): verify, profile, solve, apply.

* :func:`plan_for_model` runs them end to end (``plan.apply(model)`` is stage 4);
* :mod:`~revtrain.planner.profile` measures ``t_e``, ``m`` and ``m_o`` (stage 2),
  :mod:`~revtrain.planner.measure` whole training steps, :mod:`~revtrain.planner.budget` reads
  budgets such as ``"6GiB"`` or ``"50%"``;
* :mod:`~revtrain.planner.knapsack` and :mod:`~revtrain.planner.plan` are the pure parts: the
  solver (stage 3) and the data a profile and a plan are made of;
* :mod:`~revtrain.planner.sweep` chooses the batch size too (§3.4), and
  :mod:`~revtrain.planner.plots` draws it (Fig. 4, Fig. 5); :mod:`~revtrain.planner.command`
  is ``revtrain plan``.
"""

from revtrain.planner.budget import available_memory_bytes, resolve_budget
from revtrain.planner.knapsack import KnapsackSolution, solve_knapsack
from revtrain.planner.measure import (
    StepMeasurement,
    default_optimizer,
    measure_step,
    measure_step_stats,
    measure_steps,
)
from revtrain.planner.pipeline import plan_for_model, refine_plan
from revtrain.planner.plan import (
    BlockProfile,
    BudgetTooSmallError,
    Plan,
    PlanMismatchError,
    Profile,
    make_plan,
)
from revtrain.planner.profile import BlockTiming, profile_model, saved_bytes_in_context, time_blocks
from revtrain.planner.sweep import SweepPoint, SweepResult, parse_batch_sizes, resize_batch, sweep_batch_sizes

__all__ = [
    "BlockProfile",
    "BlockTiming",
    "BudgetTooSmallError",
    "KnapsackSolution",
    "Plan",
    "PlanMismatchError",
    "Profile",
    "StepMeasurement",
    "SweepPoint",
    "SweepResult",
    "available_memory_bytes",
    "default_optimizer",
    "make_plan",
    "measure_step",
    "measure_step_stats",
    "measure_steps",
    "parse_batch_sizes",
    "plan_for_model",
    "profile_model",
    "refine_plan",
    "resize_batch",
    "resolve_budget",
    "saved_bytes_in_context",
    "solve_knapsack",
    "sweep_batch_sizes",
    "time_blocks",
]
