"""Many short rounds at one shape: whether M-mode is faster or slower than plain autograd and the
peers, to a percent.

The grid of ``benchmarks/core_peers.py`` times 11 rounds per shape, enough to see a difference
of 5–10% on a shared machine. Smaller differences need many rounds: here every round times one
step of each method (the order rotating), and each method's per-round ratio to the reference
methods gives a median with a distribution-free 95% interval (``revtrain.timing.median_interval``).
Models are the stack benchmark's (``revtrain.bench.stack``: the same F/G weights for every
method). Writes ``results/paired_rounds_<shape>_<device>.md`` and ``.json``.

    python benchmarks/paired_rounds.py --shape 8x16x8x16 --rounds 400
    python benchmarks/paired_rounds.py --shape 32x64x32x16 --device cuda --rounds 200
    python benchmarks/paired_rounds.py --shape 8x16x8x16 --methods plain M M-nocheck M-check4 revlib
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from revtrain.bench import StackBenchConfig, machine_info
from revtrain.bench.results import write_result
from revtrain.bench.stack import _time_round_robin, parse_stack_shape, stack_setup
from revtrain.device import resolve_device
from revtrain.timing import block_ratios, median_interval

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8x16x8x16", help="BATCHxCHANNELSxSIZExDEPTH")
    parser.add_argument("--methods", nargs="+", default=["plain", "M", "M-nocheck", "revlib"])
    parser.add_argument("--references", nargs="+", default=["plain", "revlib"],
                        help="methods every other method is paired against (where present)")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--block", type=int, default=None,
                        help="pair totals over blocks of this many rounds (default: 4 where M-check4, "
                             "which checks one step in 4, is measured, else 1: every round)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... or auto")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def run(
    shape: tuple[int, int, int, int], methods: list[str], rounds: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    """Wall seconds of one step per method: the stack benchmark's round-robin (one step of each
    method per round, the order rotating, the device synchronised around each step), for
    ``rounds`` rounds."""
    batch, channels, size, depth = shape
    config = StackBenchConfig(batch=batch, channels=channels, size=size, depths=(depth,),
                              methods=tuple(methods), repeats=rounds, warmup=warmup, device=str(device))
    models, x, params = stack_setup(depth, config, device)
    wall, _ = _time_round_robin(models, x, params, config, device)
    return wall


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shape = parse_stack_shape(args.shape)
    except ValueError as e:
        raise SystemExit(f"--shape: {e}") from None
    methods = args.methods if "plain" in args.methods else ["plain", *args.methods]
    block = args.block if args.block is not None else (4 if "M-check4" in methods else 1)
    if block < 1 or args.rounds < 2 * block:
        raise SystemExit(f"--block must be at least 1 and --rounds at least two blocks ({2 * max(block, 1)})")
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"--device: {e}") from None
    before = machine_info(device)
    start = time.perf_counter()
    times = run(shape, methods, args.rounds, args.warmup, device)  # type: ignore[arg-type]
    wall = time.perf_counter() - start
    after = machine_info(device)
    refs = [r for r in args.references if r in times]
    rows = []
    for name, ts in times.items():
        row = {"method": name, "median_ms": statistics.median(ts) * 1e3, "mean_ms": statistics.fmean(ts) * 1e3,
               "paired": {}}
        for ref in refs:
            if ref != name:
                row["paired"][ref] = median_interval(block_ratios(ts, times[ref], block))._asdict()
        rows.append(row)
    coverage = median_interval([0.0] * (args.rounds // block)).coverage
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(["python", "benchmarks/paired_rounds.py", *argv])
    b, c, s, d = shape
    lines = [
        f"# Paired rounds at batch {b}, {c} channels, {s}×{s}, depth {d}",
        "",
        "One step of each method per round (order rotating), per-round ratios to the reference "
        f"methods: median [interval], the interval holding the true median with probability {coverage:.1%} "
        "(order statistics, `revtrain.timing.median_interval`)."
        + (f" Ratios are of total times over blocks of {block} rounds ({args.rounds // block} blocks): a method "
           "that checks one step in 4 has cheap and dear steps, and the block totals give its mean, what "
           "throughput sees." if block > 1 else ""),
        "",
        f"- command: `{command}`",
        f"- device: {_device_words(before)}, torch {before['torch']}, {before['torch_threads']} threads",
        f"- date: {before['date']}; {args.rounds} rounds, wall {wall:.0f} s; load average before "
        f"{before['load_average']}, after {after['load_average']}",
        "",
        "| method | median step | mean step | " + " | ".join(f"/ {r}" for r in refs) + " |",
        "|:---|---:|---:|" + "---|" * len(refs),
    ]
    for row in rows:
        cells = []
        for ref in refs:
            p = row["paired"].get(ref)
            cells.append("–" if p is None else f"{p['median']:.3f} [{p['low']:.3f}, {p['high']:.3f}]")
        lines.append(f"| {row['method']} | {row['median_ms']:.2f} ms | {row['mean_ms']:.2f} ms | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out if args.out is not None else ROOT / "results" / f"paired_rounds_{args.shape}_{device.type}"
    write_result(out, text, {
        "command": command, "machine": before, "machine_after": after, "wall_s": wall, "shape": shape,
        "rounds": args.rounds, "block": block, "rows": rows, "times_s": times})
    return 0


def _device_words(info: dict) -> str:
    """``cpu (model)`` or ``cuda (GPU name)``, as the results header names the device."""
    return f"{info['device']} ({info['gpu'] if 'gpu' in info else info['cpu']})"


if __name__ == "__main__":
    sys.exit(main())
