"""The planner benchmark across batch sizes (``revtrain bench planner``).

:mod:`~revtrain.bench.batch_sweep.schema` says what it is asked and what it records,
:mod:`~revtrain.bench.batch_sweep.runner` measures, :mod:`~revtrain.bench.batch_sweep.tables`
states the findings.
"""

from revtrain.bench.batch_sweep.runner import auto_budget, run_planner_benchmark, to_sweep_result
from revtrain.bench.batch_sweep.schema import (
    SETTINGS,
    PlannerBenchConfig,
    PlannerBenchResult,
    PlannerBenchRow,
    SettingResult,
)
from revtrain.bench.batch_sweep.tables import summary_lines

__all__ = [
    "SETTINGS",
    "PlannerBenchConfig",
    "PlannerBenchResult",
    "PlannerBenchRow",
    "SettingResult",
    "auto_budget",
    "run_planner_benchmark",
    "summary_lines",
    "to_sweep_result",
]
