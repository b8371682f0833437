"""The planner: choose per layer what backward keeps: M-mode (rebuild) or C-mode (keep) per
reversible block, keep or recompute (on CUDA also offload) per other layer.

The paper's four stages (Jiang et al. 2021, §3.3), one file each:

* :mod:`~revtrain.planner.verify` — stage 1, every block rebuilds its input;
* :mod:`~revtrain.planner.profile` — stage 2, ``t_e`` (:mod:`~revtrain.planner.block_timing`),
  ``m`` and ``m_o`` measured on this machine;
* :mod:`~revtrain.planner.solve` — stage 3, the knapsack (:mod:`~revtrain.planner.knapsack`)
  and the refinement against measured peaks;
* :mod:`~revtrain.planner.apply` — stage 4, set each block's mode.

:func:`plan_for_model` runs 1-3 (:mod:`~revtrain.planner.pipeline`) on a model and batch prepared
once (:mod:`~revtrain.planner.setup`); whole steps are measured by
:func:`~revtrain.planner.measure.measure_steps`. :mod:`~revtrain.planner.data` holds what the
stages exchange (a profile, a plan), written as JSON in one envelope
(:mod:`~revtrain.planner.envelope`); :mod:`~revtrain.planner.budget` reads budgets such as
``"6GiB"`` or ``"50%"``; :mod:`~revtrain.planner.profile_options` holds how carefully it measures
(the options ``revtrain plan`` and ``revtrain train --budget`` share). :mod:`~revtrain.planner.sweep` chooses the batch size too (§3.4),
:mod:`~revtrain.planner.plots` draws it (Fig. 4, Fig. 5), and :mod:`~revtrain.planner.command`
is ``revtrain plan``.
"""

from revtrain.planner.block_timing import BlockTiming, TimingRule, time_blocks
from revtrain.planner.budget import available_memory_bytes, resolve_budget
from revtrain.planner.data import BlockProfile, LayerProfile, Plan, Profile
from revtrain.planner.errors import BudgetTooSmallError, PlanMismatchError
from revtrain.planner.knapsack import KnapsackSolution, MultipleChoiceSolution, solve_knapsack, solve_multiple_choice
from revtrain.planner.measure import StepMeasurement, measure_steps
from revtrain.planner.pipeline import PlanningResult, plan_for_model, run_pipeline
from revtrain.planner.profile import profile_model, profile_setup, saved_bytes_in_context
from revtrain.planner.profile_options import ProfileOptions
from revtrain.planner.setup import MeasurementSetup, default_optimizer, preserved_state, prepare
from revtrain.planner.recompute import LAYER_OPTIONS, get_layer_options, plain_layers, set_layer_options
from revtrain.planner.solve import CHOICES, fit_plan, make_plan, refine_plan
from revtrain.planner.sweep import parse_batch_sizes, resize_batch, sweep_batch_sizes
from revtrain.planner.sweep_result import SweepPoint, SweepResult

__all__ = [
    "CHOICES",
    "LAYER_OPTIONS",
    "BlockProfile",
    "LayerProfile",
    "MultipleChoiceSolution",
    "BlockTiming",
    "BudgetTooSmallError",
    "KnapsackSolution",
    "MeasurementSetup",
    "Plan",
    "PlanMismatchError",
    "PlanningResult",
    "ProfileOptions",
    "Profile",
    "StepMeasurement",
    "SweepPoint",
    "SweepResult",
    "TimingRule",
    "available_memory_bytes",
    "default_optimizer",
    "fit_plan",
    "get_layer_options",
    "plain_layers",
    "set_layer_options",
    "solve_multiple_choice",
    "make_plan",
    "measure_steps",
    "parse_batch_sizes",
    "plan_for_model",
    "prepare",
    "preserved_state",
    "profile_model",
    "profile_setup",
    "refine_plan",
    "resize_batch",
    "resolve_budget",
    "run_pipeline",
    "saved_bytes_in_context",
    "solve_knapsack",
    "sweep_batch_sizes",
    "time_blocks",
]
