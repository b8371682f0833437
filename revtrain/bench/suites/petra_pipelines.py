"""PETRA throughput with fair resources, against plain backprop, GPipe and 1F1B.

Every configuration runs in fresh processes with ONE thread each, on the same model and batch
and, for one block mode, the same split:

- ``plain``: one process, ordinary backprop (every block in C-mode), SGD step per batch;
- ``concurrent``: J independent ``plain`` processes at once, no communication: the most this
  machine gives J one-thread processes (cores shared with the hypervisor, memory bandwidth);
- ``petra``: J processes (revtrain.parallel's DistributedPipeline, gloo); samples/s in the
  steady state (every stage busy with a forward and a backward each tick) and over the whole
  epoch (with the pipeline's warm-up and drain); the block modes matter only in the last stage
  (forward and backward at once: C-mode stores its activations, M-mode rebuilds them), so the
  split is balanced for each mode with the unit times measured in that mode; a table shows
  where a steady-state tick of each stage goes (forward, backward, exchange, the rest);
- ``gpipe`` / ``1f1b``: J processes, ``torch.distributed.pipelining``'s ScheduleGPipe and
  Schedule1F1B on the same stages, the batch cut into ``--microbatches`` micro-batches, one SGD
  step per batch (they flush every step); run with the blocks in C-mode (plain autograd) and in
  M-mode (reversible: far less activation memory, the closest to PETRA's memory).

Per worker it also measures the peak tensor memory of a few steps in a separate, untimed pass
(``revtrain.memory.track_peak_memory``), plus parameters and optimizer state.

Every configuration runs ``--rounds`` times, the order rotating between rounds so that load
from other processes on a shared machine hits all of them alike; the best round is reported
(as ``timeit`` does) and every round is listed.

It uses the parallel package's internals (its pipeline engine, the measured split), so it runs
only inside ``revtrain bench petra`` (not ``--quick``), where a change of the engine shows.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from revtrain import set_modes
from revtrain.memory import track_peak_memory
from revtrain.models import create_model
from revtrain.parallel import PetraConfig, split_model
from revtrain.parallel.distributed import DistributedPipeline
from revtrain.parallel.petra_engine import measured_split
from revtrain.tasks import Classification
from revtrain.train.optim import param_groups

def default_args(**changes: Any) -> SimpleNamespace:
    """The measurement's settings (RevNet-38, batch 64, 32x32, J = 2 and 4, 2 rounds), with ``changes``."""
    base = dict(model="revnet38", image_size=32, batch_size=64, stages=[2, 4], batches=16, warmup=2, microbatches=4,
                methods=["plain", "concurrent", "petra", "gpipe", "1f1b"], modes=["C", "M"], extra_petra_splits=[],
                petra_microbatched=True, rounds=2, quiet_load=1.2)
    return SimpleNamespace(**{**base, **changes})


def _batch(args: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
    return x, torch.randint(0, 10, (args.batch_size,), generator=gen)


def _model(args: SimpleNamespace, modes: str = "C") -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(args.model)
    set_modes(model, modes)
    return model


def _sgd(module: torch.nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(param_groups(module, 5e-4), lr=0.01, momentum=0.9, nesterov=True)


def _static_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return params + state


# -- one process per configuration ---------------------------------------------------------------


def plain_rank(rank: int, world: int, args: SimpleNamespace, out: str) -> None:
    model, (x, y) = _model(args), _batch(args)
    opt = _sgd(model)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.batches):
        step()
    seconds = time.perf_counter() - start
    with track_peak_memory("cpu") as mem:
        step()
    _write(out, rank, {"samples_per_s": args.batches * args.batch_size / seconds, "seconds": seconds,
                       "peak_bytes": mem.peak_bytes, "static_bytes": _static_bytes(model, opt)})


def petra_rank(rank: int, world: int, args: SimpleNamespace, split: list[int], modes: str, k: int,
               out: str) -> None:
    model, (x, y) = _model(args, modes), _batch(args)
    stages = split_model(model, world, split)
    pipe = DistributedPipeline.for_rank(stages, rank, config=PetraConfig(lr=0.01, weight_decay=5e-4, accumulation=k),
                                        batch_size=args.batch_size, task=Classification(), sample=(x, y))
    j, n = world, args.batches + 2 * (world - 1)
    sizes = [args.batch_size] * n
    pipe.train_epoch(0, [(x, y)] * n if rank == 0 else None, sizes[: 2 * j])  # warm-up epoch
    dist.barrier()
    start = time.perf_counter()
    pipe.train_epoch(1, [(x, y)] * n if rank == 0 else None, sizes)
    seconds = time.perf_counter() - start
    ticks = pipe.tick_starts + [start + seconds]
    busy = range(2 * (j - 1), n)  # ticks in which every stage runs a forward and a backward
    tick_s = statistics.median(ticks[t + 1] - ticks[t] for t in busy)
    breakdown = _breakdown(pipe.tick_timings, ticks, busy)
    dist.barrier()
    with track_peak_memory("cpu") as mem:
        pipe.train_epoch(2, [(x, y)] * (2 * j) if rank == 0 else None, sizes[: 2 * j])
    _write(out, rank, {"steady_samples_per_s": args.batch_size / tick_s, "tick_s": tick_s,
                       "epoch_samples_per_s": n * args.batch_size / seconds, "epoch_batches": n,
                       "breakdown": breakdown,
                       "peak_bytes": mem.peak_bytes, "peak_buffer_bytes": pipe.ticker.peak_buffer_bytes,
                       "static_bytes": _static_bytes(pipe.stage, pipe.worker.optimizer)})


def _breakdown(timings: list[Any], ticks: list[float], busy: range) -> dict[str, float]:
    """Median seconds per steady-state tick of one stage: where its time went."""
    parts: dict[str, list[float]] = {k: [] for k in ("tick", "forward", "backward", "compute_cpu", "exchange", "other")}
    for t in busy:
        tt = timings[t]
        tick = ticks[t + 1] - ticks[t]
        parts["tick"].append(tick)
        parts["forward"].append(tt.forward_s)
        parts["backward"].append(tt.backward_s)
        parts["compute_cpu"].append(tt.forward_cpu_s + tt.backward_cpu_s)
        parts["exchange"].append(tt.exchange_s)
        parts["other"].append(tick - tt.exchange_s - tt.forward_s - tt.backward_s)
    return {k: statistics.median(v) for k, v in parts.items()}


def pipelining_rank(rank: int, world: int, args: SimpleNamespace, split: list[int], kind: str, modes: str,
                    out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model, (x, y) = _model(args, modes), _batch(args)
    stage = split_model(model, world, split)[rank]
    pstage = PipelineStage(stage, rank, world, torch.device("cpu"))
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    schedule = cls(pstage, n_microbatches=args.microbatches, loss_fn=F.cross_entropy)
    opt = _sgd(stage)

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.batches):
        step()
    seconds = time.perf_counter() - start
    dist.barrier()
    with track_peak_memory("cpu") as mem:
        step()
    _write(out, rank, {"samples_per_s": args.batches * args.batch_size / seconds, "seconds": seconds,
                       "peak_bytes": mem.peak_bytes, "static_bytes": _static_bytes(stage, opt)})


def _write(out: str, rank: int, record: dict[str, Any]) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _entry(rank: int, fn: Any, world: int, port: int, fargs: tuple) -> None:
    torch.set_num_threads(1)
    if fn is not plain_rank:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    try:
        fn(rank, world, *fargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(fn: Any, world: int, *fargs: Any) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            mp.start_processes(_entry, args=(fn, world, port, (*fargs, out)), nprocs=world, start_method="spawn")
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


# -- the run -------------------------------------------------------------------------------------


def _wait_for_quiet(limit: float, longest_s: float = 180.0) -> None:
    deadline = time.monotonic() + longest_s
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(5)


def _configurations(args: SimpleNamespace) -> list[tuple[str, int, Callable[[], dict[str, Any]]]]:
    """``(method, J, run)`` for every configuration; ``run()`` starts fresh processes and returns a row."""
    configs: list[tuple[str, int, Callable[[], dict[str, Any]]]] = []
    if "plain" in args.methods:
        def plain() -> dict[str, Any]:
            r = _run(plain_rank, 1, args)[0]
            return {"samples_per_s": r["samples_per_s"], "per_worker_bytes": [r["static_bytes"] + r["peak_bytes"]]}
        configs.append(("plain backprop", 1, plain))
    for j in args.stages:
        if "concurrent" in args.methods:
            def concurrent(j: int = j) -> dict[str, Any]:
                ranks = _run(plain_rank, j, args)
                return {"samples_per_s": sum(r["samples_per_s"] for r in ranks),
                        "per_worker_bytes": [r["static_bytes"] + r["peak_bytes"] for r in ranks]}
            configs.append((f"{j} independent plain processes at once (the machine's ceiling)", j, concurrent))
        # Balanced by each unit's time in the mode it runs in: M-mode blocks cost the last stage
        # a rebuild (forward without graph, then rebuild and backward), C-mode blocks do not.
        splits = {mo: measured_split(_model(args, mo), j, _batch(args)[0]) for mo in dict.fromkeys(["C", *args.modes])}
        extra = [[int(c) for c in text.split(",")] for text in args.extra_petra_splits]
        m = args.microbatches
        small = SimpleNamespace(**{**vars(args), "batch_size": args.batch_size // m})
        petra_runs = [(mo, splits[mo], f"balanced split {splits[mo]}", args, 1) for mo in args.modes]
        petra_runs += [("C", e, f"explicit split {e}", args, 1) for e in extra if len(e) == j]
        petra_runs += [(mo, splits[mo], f"batch {small.batch_size} × k={m}, as the micro-batches", small, m)
                       for mo in args.modes if args.petra_microbatched]
        for modes, petra_split, how, run_args, k in petra_runs if "petra" in args.methods else []:
            def petra(j: int = j, run_args: SimpleNamespace = run_args, petra_split: list[int] = petra_split,
                      modes: str = modes, k: int = k) -> dict[str, Any]:
                ranks = _run(petra_rank, j, run_args, petra_split, modes, k)
                return {"split": petra_split, "samples_per_s": ranks[0]["steady_samples_per_s"],
                        "epoch_samples_per_s": ranks[0]["epoch_samples_per_s"],
                        "per_worker_bytes": [r["static_bytes"] + r["peak_bytes"] for r in ranks],
                        "kept_input_bytes": [r["peak_buffer_bytes"] for r in ranks],
                        "breakdown": [r["breakdown"] for r in ranks]}
            configs.append((f"PETRA ({modes}-mode blocks, {how})", j, petra))
        for kind in ("gpipe", "1f1b"):
            for modes in args.modes if kind in args.methods else []:
                def pipelined(j: int = j, kind: str = kind, modes: str = modes, split: list[int] = splits[modes]) -> dict[str, Any]:
                    ranks = _run(pipelining_rank, j, args, split, kind, modes)
                    return {"split": split, "samples_per_s": ranks[0]["samples_per_s"],
                            "per_worker_bytes": [r["static_bytes"] + r["peak_bytes"] for r in ranks]}
                configs.append((f"{'GPipe' if kind == 'gpipe' else '1F1B'} ({modes}-mode blocks)", j, pipelined))
    return configs


def measure_throughput(args: SimpleNamespace, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every configuration ``args.rounds`` times in a rotating order; per configuration its best round."""
    _wait_for_quiet(args.quiet_load)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        configs = _configurations(args)
        # By method and J: GPipe, 1F1B and the micro-batched PETRA runs have one name for every J.
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {(name, j): [] for name, j, _ in configs}
        for r in range(args.rounds):  # rounds with a rotating order: other load hits every method alike
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for name, j, run in order:
                runs[name, j].append(run())
                log(f"round {r + 1}: {name} J={j}: {runs[name, j][-1]['samples_per_s']:.1f} samples/s")
    finally:
        torch.set_num_threads(threads)
    rows = []
    for name, j, _ in configs:
        best = max(runs[name, j], key=lambda row: row["samples_per_s"])
        rows.append({"method": name, "J": j, **best, "rounds": [x["samples_per_s"] for x in runs[name, j]]})
    plain = next((row for row in rows if row["method"] == "plain backprop"), None)
    for row in rows:
        if plain:
            row["speedup"] = row["samples_per_s"] / plain["samples_per_s"]
    return rows
