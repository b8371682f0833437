"""The PETRA suite's ``rank-exit`` part: how often a finished data-parallel rank dies at exit
(``revtrain bench petra --methods rank-exit``; run alone, its report is
``results/petra_<device>_rank_exit``).

Two gloo ranks each take one DDP step and one FSDP2 step on a small reversible model, destroy
the process group and end, either

- ``normal``: by returning, through the interpreter's finalization (what Python does), or
- ``exit_rank``: by :func:`revtrain.parallel.distributed.exit_rank` (flush, ``os._exit``),
  what revtrain's ranks and the test helpers do.

DDP's reducer and FSDP2's mesh keep the gloo group alive past ``destroy_process_group()``, and
its threads can race finalization: the process then aborts (SIGABRT, "terminate called without
an active exception") after its work was done. The part counts the runs in which any rank did
not exit with 0.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from revtrain.bench.report import Column, Table
from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.parallel.data_parallel import replicate, shard
from revtrain.parallel.distributed import exit_rank

__all__ = ["ENDINGS", "rank_exit_table", "run_once"]

ENDINGS = ("exit_rank", "normal")


def _model() -> nn.Module:
    torch.manual_seed(0)
    half = lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # noqa: E731
    return nn.Sequential(nn.Linear(6, 8), ReversibleSequence([ReversibleBlock(half(), half()) for _ in range(2)]),
                         nn.Linear(8, 3))


def _rank(rank: int, world: int, store: str, ending: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    x = torch.randn(4, 6)
    for wrap in (replicate, shard):
        model = wrap(_model())
        model(x).sum().backward()
    if ending == "exit_rank":
        exit_rank(0)
    dist.destroy_process_group()


def run_once(ending: str) -> list[int | None]:
    """The two ranks' exit codes for one run ending as ``ending`` (negative: killed by that signal)."""
    with tempfile.TemporaryDirectory(prefix="revtrain-exit-") as scratch:
        ctx = mp.start_processes(_rank, args=(2, str(Path(scratch) / "store"), ending), nprocs=2, join=False,
                                 start_method="spawn")
        for p in ctx.processes:
            p.join(120)
        return [p.exitcode for p in ctx.processes]


def rank_exit_table(runs: int, log: Callable[[str], None]) -> Table:
    """``runs`` runs of each ending; one row per ending."""
    rows = []
    for ending in ENDINGS:
        start = time.perf_counter()
        codes = [run_once(ending) for _ in range(runs)]
        failed = [c for c in codes if any(code != 0 for code in c)]
        log(f"rank exit, {ending}: {len(failed)} of {runs} runs had a rank end with a non-zero code {failed}")
        rows.append({"ending": ending, "runs": runs, "failed": len(failed),
                     "failed_codes": "; ".join(str(c) for c in failed) or "-",
                     "wall_s": time.perf_counter() - start})
    return Table(
        "rank_exit", "Ending a data-parallel rank: runs in which a rank did not exit with 0",
        [Column("ending", "ending"), Column("runs", "runs", "int"), Column("failed", "failed", "int"),
         Column("failed_codes", "exit codes of failed runs"), Column("wall_s", "wall", "s")],
        rows,
        note=("Two gloo ranks, one DDP and one FSDP2 step each on a small reversible model, then the ending: "
              "`exit_rank` (destroy, flush, `os._exit`) or a normal return through the interpreter's finalization. "
              "A negative code is the signal that killed the rank (-6: SIGABRT)."),
    )
