"""Zoo models: a whole training step in M-mode against C-mode and against the plain twin.

For each case (a reversible zoo model, an input size, a batch) the script measures whole SGD
steps (forward, cross-entropy, backward, ``optimizer.step()``) with the planner's one measuring
function (:func:`revtrain.planner.measure_steps`): M-mode and C-mode steps of the same model
alternate in rounds, so load changes hit both alike; the same again with the rebuild check off
(``set_rebuild_checks(model, 0)``); then the plain twin (ordinary residual blocks, the same
recipe) on the same batch. Issue 11's goal is M / C <= 1.25.

Beside M / C the tables give what M-mode must add to a C-mode step, whatever the library:
running the reversible blocks once more in backward. A phase split (:func:`phase_times`: C,
M, M without the check and a forward without a graph, one after the other in each round)
times each step's forward, backward and the part of the forward spent in the reversible
blocks, and gives two rebuild floors (:func:`floors`): ``1 +`` one forward of the blocks
without a graph (what M-mode's forward runs) or with one (what its backward runs again:
Algorithm 1 builds each block's graph once and backpropagates through it) over C-mode's
forward plus backward. M / C without the check near those floors leaves nothing but the
rebuild; the gap between M / C with and without the check is the check.
Writes ``results/zoo_modes_<device>.md`` and ``.json`` with the command, machine and load.

    python benchmarks/zoo_modes.py                      # RevNet-38/110 at digits and CIFAR sizes
    python benchmarks/zoo_modes.py --cases revnet38:8:64 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from revtrain.bench import machine_info
from revtrain.bench.results import write_result
from revtrain.core import ReversibleSequence, set_modes, set_rebuild_checks
from revtrain.device import synchronize
from revtrain.memory import format_bytes
from revtrain.models import create_model, input_spec
from revtrain.planner import measure_steps, prepare

ROOT = Path(__file__).resolve().parent.parent

TWINS = {"revnet38": "resnet32", "revnet110": "resnet110", "revnet164": "resnet164"}
"""Each reversible model's plain twin in the zoo."""

DEFAULT_CASES = ("revnet38:8:64", "revnet38:32:128", "revnet110:8:64", "revnet110:32:128")
"""``model:image side:batch``: digits size (8×8, the training default) and CIFAR size (32×32)."""

PHASE_SETTINGS = (("C", "C", 1), ("M", "M", 1), ("M, no check", "M", 0))
"""The phase split's settings: name, mode, rebuild check interval."""


def measure_case(model_name: str, side: int, batch_size: int, repeats: int, warmup: int, device: str = "cpu",
                 phase_rounds: int = 20) -> dict:
    spec = input_spec(model_name, input_size=(3 if side == 32 else 1, side, side))
    overrides = {"in_channels": spec.shape[0], "num_classes": 10}
    torch.manual_seed(0)
    batch = spec.example(batch_size)
    model = create_model(model_name, **overrides)
    with prepare(model, batch, device=device, repeats=repeats, warmup=warmup) as setup:
        modes = measure_steps(setup, {"M": "M", "C": "C"})
        set_rebuild_checks(model, 0)
        unchecked = measure_steps(setup, {"M": "M", "C": "C"})
        set_rebuild_checks(model, 1)
        phases = phase_times(setup, phase_rounds)
    split = floors(phases)
    twin_name = TWINS[model_name]
    torch.manual_seed(0)
    twin = create_model(twin_name, **overrides)
    with prepare(twin, batch, device=device, repeats=repeats, warmup=warmup) as setup:
        plain = measure_steps(setup, {"plain": None})["plain"]
    m, c = modes["M"], modes["C"]
    return {
        "model": model_name, "twin": twin_name, "side": side, "batch": batch_size,
        "M_s": m.step_time_s, "C_s": c.step_time_s, "plain_s": plain.step_time_s,
        "M_over_C": m.step_time_s / c.step_time_s, "M_over_C_paired": _paired_median(m.times_s, c.times_s),
        "M_nocheck_s": unchecked["M"].step_time_s, "C_nocheck_run_s": unchecked["C"].step_time_s,
        "M_nocheck_over_C_paired": _paired_median(unchecked["M"].times_s, unchecked["C"].times_s),
        "M_over_plain": m.step_time_s / plain.step_time_s, "C_over_plain": c.step_time_s / plain.step_time_s,
        "M_peak": m.peak_bytes, "C_peak": c.peak_bytes, "plain_peak": plain.peak_bytes,
        "rounds": len(m.times_s), "rounds_nocheck": len(unchecked["M"].times_s),
        "phases": phases, "phase_rounds": phase_rounds, "phase_ratios": split,
        "floor": split["floor"], "floor_graph": split["floor_graph"],
    }


def _paired_median(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Median of the per-round ratios ``a[i] / b[i]`` (the two steps timed in the same round)."""
    return statistics.median(x / y for x, y in zip(a, b))


def phase_times(setup, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds of a step's parts in each of :data:`PHASE_SETTINGS`, one step of each
    per round after one untimed round, plus a forward without a graph (``"C, no graph"``):
    ``forward_s`` (with the loss), ``backward_s`` and ``blocks_s``, the part of the forward
    spent in the reversible blocks (hooks around each top-level ``ReversibleSequence``). In
    C-mode that is one forward of the blocks with a graph, what M-mode's backward runs again to
    rebuild; without a graph, what M-mode's forward runs. No optimizer step: the weights stay
    as prepared, so every round times the same computation."""
    model, sync = setup.model, functools.partial(synchronize, setup.device)
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    inner = {id(c) for m in sequences for c in m.modules() if c is not m and isinstance(c, ReversibleSequence)}
    spent = [0.0]
    started: list[float] = []

    def before(*_):
        sync()
        started.append(time.perf_counter())

    def after(*_):
        sync()
        spent[0] += time.perf_counter() - started.pop()

    handles = []
    for m in sequences:
        if id(m) not in inner:
            handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    settings = (*PHASE_SETTINGS, ("C, no graph", "C", 1))
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in settings}
    setup.reset()
    model.train()
    try:
        for r in range(rounds + 1):
            for name, mode, every in settings:
                set_modes(model, mode)
                set_rebuild_checks(model, every)
                model.zero_grad(set_to_none=True)
                graph = name != "C, no graph"
                spent[0] = 0.0
                sync()
                t0 = time.perf_counter()
                with torch.set_grad_enabled(graph):
                    loss = setup.loss()
                sync()
                t1 = time.perf_counter()
                if graph:
                    loss.backward()
                    sync()
                t2 = time.perf_counter() if graph else t1  # nothing to backpropagate
                del loss
                if r:
                    times[name].append((t1 - t0, t2 - t1, spent[0]))
    finally:
        for h in handles:
            h.remove()
        set_rebuild_checks(model, 1)
        setup.reset()
    return {name: {key: statistics.median(t[k] for t in parts) for k, key in enumerate(("forward_s", "backward_s", "blocks_s"))}
            for name, parts in times.items()}


def floors(phases: dict[str, dict[str, float]]) -> dict[str, float]:
    """Ratios of forward plus backward to C-mode's, from the phase split's medians: M, M
    without the check, and the two rebuild floors, ``1 +`` one forward of the reversible
    blocks without / with a graph over C-mode's forward plus backward."""
    c = phases["C"]["forward_s"] + phases["C"]["backward_s"]

    def total(name: str) -> float:
        return phases[name]["forward_s"] + phases[name]["backward_s"]

    return {
        "M": total("M") / c,
        "M, no check": total("M, no check") / c,
        "floor": 1 + phases["C, no graph"]["blocks_s"] / c,
        "floor_graph": 1 + phases["C"]["blocks_s"] / c,
    }


def to_markdown(rows: list[dict], info: dict, command: str, load: tuple, threads: int, device: str = "cpu") -> str:
    lines = [
        "# Zoo models: M-mode step against C-mode and the plain twin",
        "",
        f"- command: `{command}`",
        f"- device: {_describe(device, info)}, torch {torch.__version__}, {threads} thread(s), {os.cpu_count()} CPUs",
        f"- load average before: {load[0]}, after: {load[1]}",
        "- whole SGD steps (forward, cross-entropy, backward, optimizer step); M and C alternate in rounds "
        "until each median is known to 2% (planner's measure_steps), then M without the rebuild check and C "
        "again; the twin is measured after, on the same batch",
        "- rebuild floors (from the phase split below) = 1 + one forward of the reversible blocks, without / with "
        "a graph, over C-mode's forward plus backward: M / C if running those blocks once more were all M-mode added",
        "",
        "| model | input | batch | M step | C step | M / C (paired median) | M / C, no check (paired) | "
        "rebuild floor, no graph | with graph | goal ≤ 1.25 | twin | twin step | M / twin | M peak | C peak | twin peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ok = "met" if r["M_over_C_paired"] <= 1.25 else "not met"
        lines.append(
            f"| {r['model']} | {r['side']}×{r['side']} | {r['batch']} | {r['M_s'] * 1e3:.1f} ms | {r['C_s'] * 1e3:.1f} ms | "
            f"{r['M_over_C']:.3f} ({r['M_over_C_paired']:.3f}) | {r['M_nocheck_over_C_paired']:.3f} | {r['floor']:.2f} | "
            f"{r['floor_graph']:.2f} | {ok} | {r['twin']} | {r['plain_s'] * 1e3:.1f} ms | "
            f"{r['M_over_plain']:.2f} | {format_bytes(r['M_peak'])} | {format_bytes(r['C_peak'])} | {format_bytes(r['plain_peak'])} |"
        )
    lines += [
        "",
        "## Where M-mode's time goes",
        "",
        "Medians of forward (with the loss), backward and the forward's time in the reversible blocks, the "
        f"settings one after the other in each round ({rows[0]['phase_rounds'] if rows else 0} rounds after one "
        "untimed; no optimizer step). C-mode's blocks run with a graph: what M-mode's backward runs again. "
        "M-mode's backward should cost C-mode's backward plus that; its forward, C-mode's less the graph. "
        "Ratios are of forward plus backward.",
        "",
        "| model | input | batch | C fwd | C bwd | C fwd in blocks (= rebuild) | M fwd | M bwd | M fwd, no check | "
        "M bwd, no check | M bwd (no check) − C bwd | M / C | M / C, no check | floor, no graph | floor, with graph |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = {name: {k: v * 1e3 for k, v in part.items()} for name, part in r["phases"].items()}
        c, m, n, q = ms["C"], ms["M"], ms["M, no check"], r["phase_ratios"]
        lines.append(
            f"| {r['model']} | {r['side']}×{r['side']} | {r['batch']} | {c['forward_s']:.1f} ms | {c['backward_s']:.1f} ms | "
            f"{c['blocks_s']:.1f} ms | {m['forward_s']:.1f} ms | {m['backward_s']:.1f} ms | {n['forward_s']:.1f} ms | "
            f"{n['backward_s']:.1f} ms | {n['backward_s'] - c['backward_s']:.1f} ms | {q['M']:.3f} | {q['M, no check']:.3f} | "
            f"{q['floor']:.3f} | {q['floor_graph']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _describe(device: str, info: dict) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({info.get('cpu', '')})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="model:side:batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds at least (more until stable)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per setting")
    parser.add_argument("--phase-rounds", type=int, default=20, help="rounds of the forward/backward split")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="path without suffix (default results/zoo_modes_<device>)")
    args = parser.parse_args(argv)
    if args.phase_rounds < 1:
        parser.error("--phase-rounds must be at least 1")
    cases = []
    for case in args.cases:
        try:
            name, side, batch = case.split(":")
            cases.append((name, int(side), int(batch)))
        except ValueError:
            parser.error(f"a case is model:side:batch, e.g. revnet38:8:64; got {case!r}")
        if name not in TWINS:
            parser.error(f"no plain twin known for {name}; choose from {sorted(TWINS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/zoo_modes.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    before = os.getloadavg()
    rows = []
    for name, side, batch in cases:
        rows.append(measure_case(name, side, batch, args.repeats, args.warmup, args.device, args.phase_rounds))
        r = rows[-1]
        print(f"{name}:{side}:{batch}: M {r['M_s'] * 1e3:.1f} ms, C {r['C_s'] * 1e3:.1f} ms, M/C {r['M_over_C']:.3f} "
              f"(paired {r['M_over_C_paired']:.3f}; no check {r['M_nocheck_over_C_paired']:.3f}; rebuild floors "
              f"{r['floor']:.3f}, {r['floor_graph']:.3f} with graph), twin {r['plain_s'] * 1e3:.1f} ms", flush=True)
    after = os.getloadavg()
    info = machine_info(torch.device(args.device))
    out = args.out or ROOT / "results" / f"zoo_modes_{args.device.split(':')[0]}"
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    data = {"command": command, "date": stamp, "load_before": before, "load_after": after,
            "threads": torch.get_num_threads(), "machine": info, "rows": rows}
    write_result(out, to_markdown(rows, info, command, (before, after), torch.get_num_threads(), args.device), data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
