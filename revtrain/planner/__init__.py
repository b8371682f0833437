"""The planner: choose per reversible block between M-mode (memory) and C-mode (speed).

Stages (Jiang et al. 2021, §3.3): verify, profile, solve, apply. This package holds the pure
parts: the knapsack solver and the data a profile and a plan are made of.
"""

from revtrain.planner.knapsack import KnapsackSolution, solve_knapsack
from revtrain.planner.plan import (
    BlockProfile,
    BudgetTooSmallError,
    Plan,
    PlanMismatchError,
    Profile,
    make_plan,
)

__all__ = [
    "BlockProfile",
    "BudgetTooSmallError",
    "KnapsackSolution",
    "Plan",
    "PlanMismatchError",
    "Profile",
    "make_plan",
    "solve_knapsack",
]
