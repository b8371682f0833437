"""Run in a fresh process by ``test_memtracker.py``: torch's ``MemTracker`` against the planner.

A fresh process each matters: caches a library keeps between steps are made by the first step of
a process, and ``MemTracker`` counts only what it sees made. Prints one JSON line.

    python -m tests.planner.memtracker_check memtracker NAME BATCH SIZE...   # baseline-M, MemTracker
    python -m tests.planner.memtracker_check planner NAME BATCH SIZE...      # baseline-M, the planner
    python -m tests.planner.memtracker_check plan NAME BATCH PLAN.json SIZE...  # a plan, MemTracker
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from revtrain.models import create_model_for, input_spec
from revtrain.planner import Plan, measure_steps, prepare
from revtrain.planner.setup import default_optimizer
from revtrain.tasks import task_for


def build(name: str, batch_size: int, size: tuple[int, ...]):
    spec = input_spec(name, input_size=size or None)
    torch.manual_seed(0)
    model = create_model_for(name, spec)
    return model, spec.example(batch_size, "cpu", seed=0), task_for(spec).loss


def memtracker_peak(model, batch, loss_fn) -> int:
    """MemTracker's peak over a first step and a second, steady one (optimizer state live)."""
    x, y = batch
    optimizer = default_optimizer(model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, optimizer, x, y)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    with tracker:
        step()
        tracker.reset_mod_stats()  # per-module statistics; the peak over both steps stays
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    what, name, batch_size = argv[0], argv[1], int(argv[2])
    if what in ("memtracker", "planner"):
        model, batch, loss_fn = build(name, batch_size, tuple(int(a) for a in argv[3:]))
        if what == "memtracker":
            print(json.dumps({"peak": memtracker_peak(model, batch, loss_fn)}))
            return
        with prepare(model, batch, loss_fn=loss_fn, repeats=0, warmup=1) as setup:
            print(json.dumps({"peak": measure_steps(setup, {"M": "M"})["M"].peak_bytes}))
    else:
        plan = Plan.from_json(argv[3])
        model, batch, loss_fn = build(name, batch_size, tuple(int(a) for a in argv[4:]))
        plan.apply(model)
        print(json.dumps({"memtracker": memtracker_peak(model, batch, loss_fn)}))


if __name__ == "__main__":
    main(sys.argv[1:])
