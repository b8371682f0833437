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

    flock /tmp/revtrain-cpu.lock python benchmarks/petra_throughput.py            # J = 2 and 4
    python benchmarks/petra_throughput.py --stages 2 --batches 12 --out results/x
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from revtrain.bench import machine_info
from revtrain.core import set_modes
from revtrain.memory import format_bytes, track_peak_memory
from revtrain.models import create_model
from revtrain.parallel import PetraConfig, split_model
from revtrain.parallel.distributed import DistributedPipeline
from revtrain.parallel.runner import measured_split
from revtrain.tasks import Classification
from revtrain.train.optim import param_groups

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="revnet38")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batches", type=int, default=16, help="timed batches per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (plain, pipelining)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of GPipe and 1F1B")
    p.add_argument("--methods", nargs="+", default=["plain", "concurrent", "petra", "gpipe", "1f1b"])
    p.add_argument("--modes", nargs="+", default=["C", "M"], help="block modes to run PETRA, GPipe and 1F1B with")
    p.add_argument("--extra-petra-splits", nargs="*", default=[],
                   help="explicit splits (e.g. 3,6) to run PETRA with as well, besides the measured balanced one")
    p.add_argument("--petra-microbatched", action=argparse.BooleanOptionalAction, default=True,
                   help="also run PETRA on batches of batch/microbatches with k=microbatches (the same effective "
                        "batch and step memory class as GPipe and 1F1B)")
    p.add_argument("--rounds", type=int, default=2,
                   help="run every configuration this many times (rotating order); the best is reported")
    p.add_argument("--quiet-load", type=float, default=1.2,
                   help="wait (up to 3 min) until the 1-min load average is below this before measuring")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "petra_throughput_cpu")
    return p.parse_args(argv)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
    return x, torch.randint(0, 10, (args.batch_size,), generator=gen)


def _model(args: argparse.Namespace, modes: str = "C") -> torch.nn.Module:
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


def plain_rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
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


def petra_rank(rank: int, world: int, args: argparse.Namespace, split: list[int], modes: str, k: int,
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


def pipelining_rank(rank: int, world: int, args: argparse.Namespace, split: list[int], kind: str, modes: str,
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


def _configurations(args: argparse.Namespace) -> list[tuple[str, int, Callable[[], dict[str, Any]]]]:
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
        small = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size // m})
        petra_runs = [(mo, splits[mo], f"balanced split {splits[mo]}", args, 1) for mo in args.modes]
        petra_runs += [("C", e, f"explicit split {e}", args, 1) for e in extra if len(e) == j]
        petra_runs += [(mo, splits[mo], f"batch {small.batch_size} × k={m}, as the micro-batches", small, m)
                       for mo in args.modes if args.petra_microbatched]
        for modes, petra_split, how, run_args, k in petra_runs if "petra" in args.methods else []:
            def petra(j: int = j, run_args: argparse.Namespace = run_args, petra_split: list[int] = petra_split,
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _wait_for_quiet(args.quiet_load)
    before = machine_info("cpu")
    torch.set_num_threads(1)
    configs = _configurations(args)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    for r in range(args.rounds):  # rounds with a rotating order: other load hits every method alike
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for name, j, run in order:
            runs[name].append(run())
            print(f"round {r + 1}: {name} J={j}: {runs[name][-1]['samples_per_s']:.1f} samples/s", flush=True)
    rows = []
    for name, j, _ in configs:
        best = max(runs[name], key=lambda row: row["samples_per_s"])
        rows.append({"method": name, "J": j, **best, "rounds": [x["samples_per_s"] for x in runs[name]]})
    after = machine_info("cpu")
    plain = next((row for row in rows if row["method"] == "plain backprop"), None)
    for row in rows:
        if plain:
            row["speedup"] = row["samples_per_s"] / plain["samples_per_s"]
        row["goal"] = 0.56 * row["J"] if row["method"].startswith("PETRA") else None
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    result = {"command": command, "machine_before": before, "machine_after": after, "args": {
        k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"# PETRA throughput: {a['model']}, batch {a['batch_size']}, {a['image_size']}x{a['image_size']}, "
        "one thread per process (CPU)",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine_before']['cpu']}, {result['machine_before']['cpu_count']} cores, torch "
        f"{result['machine_before']['torch']}; 1-min load average before {result['machine_before']['load_average']}, "
        f"after {result['machine_after']['load_average']}",
        "",
        "| method | J | samples/s (best of rounds; all rounds) | × plain | goal | per-worker memory (params + optimizer + peak of a step) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        sps = f"**{r['samples_per_s']:.1f}** ({', '.join(f'{x:.1f}' for x in r['rounds'])})"
        if "epoch_samples_per_s" in r:
            sps += f"; epoch {r['epoch_samples_per_s']:.1f}"
        goal = f"≥ {r['goal']:.2f}×" if r.get("goal") else ""
        mem = ", ".join(format_bytes(b) for b in r["per_worker_bytes"])
        speedup = f"{r['speedup']:.2f}×" if "speedup" in r else "—"
        lines.append(f"| {r['method']} | {r['J']} | {sps} | {speedup} | {goal} | {mem} |")
    lines += ["", "PETRA's samples/s is the steady state (every stage busy with one forward and one backward "
              "per tick; median tick); 'epoch' includes the pipeline's warm-up and drain over "
              f"{a['batches']} batches + 2(J-1). GPipe and 1F1B cut each batch into {a['microbatches']} "
              "micro-batches and flush every step. 'PETRA (batch B/m × k=m)' runs PETRA on micro-batch-sized "
              "batches, averaging k=m of them per update: the same effective batch per update as GPipe and 1F1B "
              "and the same size of the tensors a step moves and keeps. Per-worker memory is what a worker's "
              "tensors take at its peak (parameters, optimizer state, activations, kept inputs, messages).", ""]
    lines += _breakdown_markdown(result["rows"])
    return "\n".join(lines)


def _breakdown_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """Per PETRA row (its best round) and stage: median milliseconds of a steady-state tick."""
    petra = [r for r in rows if "breakdown" in r]
    if not petra:
        return []
    lines = ["## Where a steady-state tick goes (PETRA, best round, median ms per tick)", "",
             "| method | stage | tick | forward | backward (+ update) | compute CPU | exchange (comm + wait) | other |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in petra:
        for s, b in enumerate(r["breakdown"]):
            ms = {k: f"{v * 1e3:.1f}" for k, v in b.items()}
            lines.append(f"| {r['method']} | {s} | {ms['tick']} | {ms['forward']} | {ms['backward']} | "
                         f"{ms['compute_cpu']} | {ms['exchange']} | {ms['other']} |")
    lines += ["", "forward: the last stage's forward, loss and backward; compute CPU: the computing thread's CPU "
              "time (below forward + backward: the stage waited for a core); exchange: posting the tick's "
              "sends and receives and waiting for the receives (communication, and idling for the slower "
              "neighbour); other: the rest of the tick (reading the batch, Python).", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
