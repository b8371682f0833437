"""How often a finished data-parallel rank dies at exit: the minimal case, run many times.

Two gloo ranks each take one DDP step and one FSDP2 step on a small reversible model, destroy
the process group and end, either

- ``normal``: by returning, through the interpreter's finalization (what Python does), or
- ``exit_rank``: by :func:`revtrain.parallel.distributed.exit_rank` (flush, ``os._exit``),
  what revtrain's ranks and the test helpers do.

DDP's reducer and FSDP2's mesh keep the gloo group alive past ``destroy_process_group()``, and
its threads can race finalization: the process then aborts (SIGABRT, "terminate called without
an active exception") after its work was done. Counts the runs in which any rank did not exit
with 0.

    python benchmarks/rank_exit.py --runs 20 --ending exit_rank normal
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from revtrain.bench import machine_info
from revtrain.bench.results import write_result
from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.parallel.data_parallel import replicate, shard
from revtrain.parallel.distributed import exit_rank

ROOT = Path(__file__).resolve().parent.parent


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
    """The ranks' exit codes (negative: killed by that signal)."""
    with tempfile.TemporaryDirectory(prefix="revtrain-exit-") as scratch:
        ctx = mp.start_processes(_rank, args=(2, str(Path(scratch) / "store"), ending), nprocs=2, join=False,
                                 start_method="spawn")
        for p in ctx.processes:
            p.join(120)
        return [p.exitcode for p in ctx.processes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ending", nargs="+", default=["exit_rank", "normal"], choices=["exit_rank", "normal"])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "petra_cpu_rank_exit")
    args = parser.parse_args(argv)
    rows = {}
    for ending in args.ending:
        start = time.perf_counter()
        codes = [run_once(ending) for _ in range(args.runs)]
        failed = [c for c in codes if any(code != 0 for code in c)]
        rows[ending] = {"runs": args.runs, "failed": len(failed), "failed_codes": failed,
                        "seconds": round(time.perf_counter() - start, 1)}
        print(f"{ending}: {len(failed)} of {args.runs} runs had a rank end with a non-zero code {failed}", flush=True)
    lines = ["# Ending a data-parallel rank: runs in which a rank did not exit with 0", "",
             f"Command: `python benchmarks/rank_exit.py --runs {args.runs} --ending {' '.join(args.ending)}`; "
             f"load average at the end {os.getloadavg()[0]:.1f}.", "",
             "| ending | runs | failed | exit codes of failed runs |", "|---|---:|---:|---|"]
    lines += [f"| {k} | {v['runs']} | {v['failed']} | {v['failed_codes'] or '-'} |" for k, v in rows.items()]
    write_result(args.out, "\n".join(lines) + "\n", {"machine": machine_info("cpu"), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
