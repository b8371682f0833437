"""Benchmarks as a library: measure, return rows, format them (the scripts in ``benchmarks/``
and a future ``revtrain bench`` command are thin wrappers over these)."""

from revtrain.bench.machine import cpu_model, load_average, machine_info
from revtrain.bench.peers import PEERS, installed_peers
from revtrain.bench.stack import (
    METHODS,
    OURS,
    GradientMismatchError,
    StackBenchConfig,
    StackBenchRow,
    format_table,
    resolve_device,
    run_stack_benchmark,
)

__all__ = [
    "METHODS",
    "OURS",
    "PEERS",
    "installed_peers",
    "GradientMismatchError",
    "StackBenchConfig",
    "StackBenchRow",
    "cpu_model",
    "format_table",
    "load_average",
    "machine_info",
    "resolve_device",
    "run_stack_benchmark",
]
