"""The planner benchmark across batch sizes (``benchmarks/planner_sweep.py``).

:mod:`~revtrain.bench.batch_sweep.schema` says what it is asked and what it records,
:mod:`~revtrain.bench.batch_sweep.runner` measures, :mod:`~revtrain.bench.batch_sweep.tables`
draws the markdown tables and the findings.
"""

from revtrain.bench.batch_sweep.runner import auto_budget, run_planner_benchmark, to_sweep_result
from revtrain.bench.batch_sweep.schema import (
    SETTINGS,
    PlannerBenchConfig,
    PlannerBenchResult,
    PlannerBenchRow,
    SettingResult,
)
from revtrain.bench.batch_sweep.tables import (
    format_accuracy_table,
    format_planner_table,
    format_refine_table,
    summary_lines,
)

__all__ = [
    "SETTINGS",
    "PlannerBenchConfig",
    "PlannerBenchResult",
    "PlannerBenchRow",
    "SettingResult",
    "auto_budget",
    "format_accuracy_table",
    "format_planner_table",
    "format_refine_table",
    "run_planner_benchmark",
    "summary_lines",
    "to_sweep_result",
]
