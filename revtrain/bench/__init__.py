"""Benchmarks as a library: ``revtrain bench SUITE`` (:mod:`revtrain.bench.runner`) runs one of the
suites of :mod:`revtrain.bench.suites` and writes its :class:`~revtrain.bench.report.Report`;
the measuring code the suites share lives beside them (the reversible stack of :mod:`stack`, the
peer libraries of :mod:`peers`, the planner sweep of :mod:`batch_sweep`)."""

from revtrain.bench.machine import cpu_model, load_average, machine_info
from revtrain.bench.peers import PEERS, installed_peers
from revtrain.bench.report import Column, Report, Table, write_report
from revtrain.bench.runner import SUITES, BenchOptions, run_suite
from revtrain.bench.stack import (
    EXTRA_METHODS,
    METHODS,
    OURS,
    GradientMismatchError,
    StackBenchConfig,
    StackBenchRow,
    resolve_device,
    run_stack_benchmark,
)

__all__ = [
    "EXTRA_METHODS",
    "METHODS",
    "OURS",
    "PEERS",
    "SUITES",
    "BenchOptions",
    "Column",
    "GradientMismatchError",
    "Report",
    "StackBenchConfig",
    "StackBenchRow",
    "Table",
    "cpu_model",
    "installed_peers",
    "load_average",
    "machine_info",
    "resolve_device",
    "run_stack_benchmark",
    "run_suite",
    "write_report",
]
