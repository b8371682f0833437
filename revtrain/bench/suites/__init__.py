"""The benchmark suites of ``revtrain bench``: one module per question (see :mod:`revtrain.bench.runner`).

Each module has ``run(options, device, out, log) -> Report``. Suites
use revtrain's public API (and the planner's and parallel package's public entry points), so
that a rewrite of the internals does not break them.
"""
