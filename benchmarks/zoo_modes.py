"""Zoo models: a whole training step in M-mode against C-mode and against the plain twin.

For each case (a reversible zoo model, an input size, a batch) the script measures whole SGD
steps (forward, cross-entropy, backward, ``optimizer.step()``) with the planner's one measuring
function (:func:`revtrain.planner.measure_steps`): M-mode and C-mode steps of the same model
alternate in rounds, so load changes hit both alike; then the plain twin (ordinary residual
blocks, the same recipe) is measured on the same batch. Issue 11's goal is M / C <= 1.25. The
rebuild floor beside it is ``1 +`` the time of one forward of the reversible blocks without a
graph over the C step (:func:`rebuild_time`): what M / C would be if running those blocks once
more in backward were all M-mode added. M / C above it is overhead beyond the rebuild (the
check, per-block bookkeeping); below it, C-mode's stored activations cost time of their own
(allocating and touching them), which M-mode saves.
Writes ``results/zoo_modes_<device>.md`` and ``.json`` with the command, machine and load.

    python benchmarks/zoo_modes.py                      # RevNet-38/110 at digits and CIFAR sizes
    python benchmarks/zoo_modes.py --cases revnet38:8:64 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from revtrain.bench import machine_info
from revtrain.core import ReversibleSequence, set_modes
from revtrain.memory import format_bytes
from revtrain.models import create_model, input_spec
from revtrain.planner import measure_steps, prepare

ROOT = Path(__file__).resolve().parent.parent

TWINS = {"revnet38": "resnet32", "revnet110": "resnet110", "revnet164": "resnet164"}
"""Each reversible model's plain twin in the zoo."""

DEFAULT_CASES = ("revnet38:8:64", "revnet38:32:128", "revnet110:8:64", "revnet110:32:128")
"""``model:image side:batch``: digits size (8×8, the training default) and CIFAR size (32×32)."""


def measure_case(model_name: str, side: int, batch_size: int, repeats: int, warmup: int, device: str = "cpu") -> dict:
    spec = input_spec(model_name, input_size=(3 if side == 32 else 1, side, side))
    overrides = {"in_channels": spec.shape[0], "num_classes": 10}
    torch.manual_seed(0)
    batch = spec.example(batch_size)
    model = create_model(model_name, **overrides)
    with prepare(model, batch, device=device, repeats=repeats, warmup=warmup) as setup:
        modes = measure_steps(setup, {"M": "M", "C": "C"})
    floor_s = rebuild_time(model, batch, repeats, device)
    twin_name = TWINS[model_name]
    torch.manual_seed(0)
    twin = create_model(twin_name, **overrides)
    with prepare(twin, batch, device=device, repeats=repeats, warmup=warmup) as setup:
        plain = measure_steps(setup, {"plain": None})["plain"]
    m, c = modes["M"], modes["C"]
    paired = [a / b for a, b in zip(m.times_s, c.times_s)]
    paired.sort()
    return {
        "model": model_name, "twin": twin_name, "side": side, "batch": batch_size,
        "M_s": m.step_time_s, "C_s": c.step_time_s, "plain_s": plain.step_time_s,
        "M_over_C": m.step_time_s / c.step_time_s, "M_over_C_paired": paired[len(paired) // 2],
        "M_over_plain": m.step_time_s / plain.step_time_s, "C_over_plain": c.step_time_s / plain.step_time_s,
        "M_peak": m.peak_bytes, "C_peak": c.peak_bytes, "plain_peak": plain.peak_bytes,
        "rounds": len(m.times_s),
        "rebuild_s": floor_s, "floor": 1 + floor_s / c.step_time_s,
    }


def rebuild_time(model: torch.nn.Module, batch, repeats: int, device: str = "cpu") -> float:
    """Median time of the work M-mode adds to a C-mode step: one forward, without a graph, of
    every reversible block (M-mode's forward builds no graph for them, its backward rebuilds
    them with one, so ``M - C`` is about this when compute decides). ``1 + this / C step`` is
    the rebuild floor of M / C in the table. Timed with hooks
    around each top-level ``ReversibleSequence`` in a C-mode forward under ``torch.no_grad``."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    x = x.to(device)
    model = model.to(device)
    set_modes(model, "C")
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    inner = {id(c) for m in sequences for c in m.modules() if c is not m and isinstance(c, ReversibleSequence)}
    spent = [0.0]
    started: list[float] = []
    sync = (lambda: torch.cuda.synchronize(x.device)) if x.is_cuda else (lambda: None)

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
    times = []
    try:
        with torch.no_grad():
            for i in range(repeats + 2):
                spent[0] = 0.0
                model(x)
                if i >= 2:
                    times.append(spent[0])
    finally:
        for h in handles:
            h.remove()
    return statistics.median(times)


def to_markdown(rows: list[dict], info: dict, command: str, load: tuple, threads: int, device: str = "cpu") -> str:
    lines = [
        "# Zoo models: M-mode step against C-mode and the plain twin",
        "",
        f"- command: `{command}`",
        f"- device: {_describe(device, info)}, torch {torch.__version__}, {threads} thread(s), {os.cpu_count()} CPUs",
        f"- load average before: {load[0]}, after: {load[1]}",
        "- whole SGD steps (forward, cross-entropy, backward, optimizer step); M and C alternate in rounds "
        "until each median is known to 2% (planner's measure_steps); the twin is measured after, on the same batch",
        "",
        "- rebuild floor = 1 + (the reversible blocks' forward without a graph) / C step: M / C if running those"
        " blocks once more in backward were all M-mode added; above it is overhead (the check, bookkeeping), below"
        " it C-mode's stored activations cost time of their own",
        "",
        "| model | input | batch | M step | C step | M / C (paired median) | rebuild floor | goal ≤ 1.25 | twin | twin step | M / twin | M peak | C peak | twin peak |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ok = "met" if r["M_over_C_paired"] <= 1.25 else "not met"
        lines.append(
            f"| {r['model']} | {r['side']}×{r['side']} | {r['batch']} | {r['M_s'] * 1e3:.1f} ms | {r['C_s'] * 1e3:.1f} ms | "
            f"{r['M_over_C']:.3f} ({r['M_over_C_paired']:.3f}) | {r['floor']:.2f} | {ok} | {r['twin']} | {r['plain_s'] * 1e3:.1f} ms | "
            f"{r['M_over_plain']:.2f} | {format_bytes(r['M_peak'])} | {format_bytes(r['C_peak'])} | {format_bytes(r['plain_peak'])} |"
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
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="path without suffix (default results/zoo_modes_<device>)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/zoo_modes.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    before = os.getloadavg()
    rows = []
    for case in args.cases:
        name, side, batch = case.split(":")
        if name not in TWINS:
            parser.error(f"no plain twin known for {name}; choose from {sorted(TWINS)}")
        rows.append(measure_case(name, int(side), int(batch), args.repeats, args.warmup, args.device))
        r = rows[-1]
        print(f"{case}: M {r['M_s'] * 1e3:.1f} ms, C {r['C_s'] * 1e3:.1f} ms, M/C {r['M_over_C']:.3f} "
              f"(paired {r['M_over_C_paired']:.3f}, rebuild floor {r['floor']:.3f}), twin {r['plain_s'] * 1e3:.1f} ms", flush=True)
    after = os.getloadavg()
    info = machine_info(torch.device(args.device))
    out = args.out or ROOT / "results" / f"zoo_modes_{args.device.split(':')[0]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "date": stamp, "load_before": before, "load_after": after,
         "threads": torch.get_num_threads(), "machine": info, "rows": rows}, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(to_markdown(rows, info, command, (before, after), torch.get_num_threads(), args.device))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
