"""revtrain against plain PyTorch, torch.utils.checkpoint and the peer libraries, across shapes.

One command, one table: for each shape (batch, channels, size, depth) the stack benchmark of
``revtrain.bench`` runs every method on the same F/G weights in one process (gradients checked
against plain autograd first, methods timed round-robin), and this script pivots the rows into
shapes × methods, with the step-time ratio to plain autograd and the peak memory of one step.
A second table compares, per shape, M-mode and C-mode with plain autograd and M-mode with each
peer: the median of the per-round ratios (the two methods timed in the same round) with a
distribution-free interval of at least 95% (``revtrain.timing.median_interval``); a peer
verdict is given only where the whole interval lies on one side of 1. Writes
``results/core_peers_<device>.md`` and ``.json``.

    python benchmarks/core_peers.py --device cpu                 # the default grid
    python benchmarks/core_peers.py --device cpu --quick         # three shapes, for a smoke run
    python benchmarks/core_peers.py --shapes 32x64x32x16 16x64x16x16 --threads 2

Peers are left out (with a note) when not installed: ``pip install --no-deps revlib memcnn
reformer-pytorch revtorch einops`` plus reformer's pinned helpers (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from revtrain.bench import OURS, PEERS, StackBenchConfig, installed_peers, machine_info, resolve_device, run_stack_benchmark
from revtrain.bench.machine import busy_machine_note
from revtrain.bench.peers import peer_status
from revtrain.bench.results import write_result
from revtrain.memory import format_bytes
from revtrain.timing import MedianInterval, median_interval

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_SHAPES = (
    "32x64x32x16",  # the goal shape: batch 32, 64 channels, 32x32, 16 blocks
    "32x64x32x4",
    "32x64x32x32",
    "16x64x16x16",
    "8x16x8x16",  # small kernels: per-call Python overhead decides, as on a GPU
    "64x128x8x8",
    "8x128x32x8",
    "64x16x32x8",
)
QUICK_SHAPES = ("32x64x32x16", "16x64x16x16", "8x16x8x16")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        batch, channels, size, depth = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a shape is BATCHxCHANNELSxSIZExDEPTH, e.g. 32x64x32x16; got {text!r}"
        ) from None
    return batch, channels, size, depth


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:N]")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        help="BATCHxCHANNELSxSIZExDEPTH shapes (default: a grid of 8)")
    parser.add_argument("--quick", action="store_true", help="three shapes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per method and shape")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--methods", nargs="+", default=None, choices=OURS + PEERS,
                        help="default: plain, M, C, checkpoint and every installed peer")
    parser.add_argument("--out", type=Path, default=None,
                        help="results path without suffix (default: results/core_peers_<device>)")
    return parser.parse_args(argv)


def pivot(results: list[tuple[tuple[int, int, int, int], list]], methods: list[str]) -> str:
    head = "| batch × ch × size, depth | " + " | ".join(methods) + " |"
    lines = [head, "|:---|" + "---:|" * len(methods)]
    for (b, c, s, d), rows in results:
        by = {r.method: r for r in rows}
        cells = []
        for m in methods:
            r = by.get(m)
            if r is None:
                cells.append("–")
                continue
            peak = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "–"
            cells.append(f"{r.time_ratio:.2f} ({r.time_ratio_paired:.2f}), {peak}")
        lines.append(f"| {b} × {c} × {s}², {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(rows: list, pairs: list[tuple[str, str]]) -> dict[str, MedianInterval]:
    """Per ``(a, b)`` pair: the per-round ratios of ``a``'s step to ``b``'s, as a median and
    its interval of at least 95% (the stack benchmark times every method once per round)."""
    by = {r.method: r.times_s for r in rows}
    return {
        f"{a}/{b}": median_interval([ta / tb for ta, tb in zip(by[a], by[b])])
        for a, b in pairs
        if a in by and b in by
    }


def comparisons(methods: list[str]) -> list[tuple[str, str]]:
    """What the head-to-head table compares: M and C with plain, M with every peer."""
    pairs = [(m, "plain") for m in ("M", "C") if m in methods]
    return pairs + [("M", p) for p in methods if p in PEERS] if "M" in methods else pairs


_VERDICTS = {"below": "faster", "above": "slower", "tie": "no difference shown"}


def head_to_head(results: list[tuple[tuple[int, int, int, int], list]], methods: list[str]) -> str:
    pairs = comparisons(methods)
    names = [f"{a} / {b}" for a, b in pairs]
    lines = ["| batch × ch × size, depth | " + " | ".join(names) + " |", "|:---|" + "---|" * len(pairs)]
    for (b, c, s, d), rows in results:
        found = paired(rows, pairs)
        cells = []
        for a, ref in pairs:
            got = found.get(f"{a}/{ref}")
            if got is None:
                cells.append("–")
                continue
            # Against plain the ratio itself is the figure (M-mode rebuilds, so it is above 1).
            verdict = "" if ref == "plain" else f" {_VERDICTS[got.verdict()]}"
            cells.append(f"{got.median:.3f} [{got.low:.3f}, {got.high:.3f}]{verdict}")
        lines.append(f"| {b} × {c} × {s}², {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    shapes = args.shapes or [parse_shape(s) for s in (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)]
    repeats = 3 if args.quick else args.repeats
    methods = args.methods or [*OURS, *installed_peers()]
    if "plain" not in methods:
        methods = ["plain", *methods]
    notes = [p for m in PEERS if m not in methods and (p := peer_status(m))]
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    before = machine_info(device)
    print(f"{device} ({before.get('gpu') or before['cpu']}), load average {before['load_average']}", flush=True)
    start = time.perf_counter()
    results = []
    for batch, channels, size, depth in shapes:
        config = StackBenchConfig(batch=batch, channels=channels, size=size, depths=(depth,),
                                  methods=tuple(methods), repeats=repeats, warmup=args.warmup,
                                  device=str(device), threads=args.threads)
        rows = run_stack_benchmark(config, log=lambda line: print(f"{batch}x{channels}x{size}: {line}", flush=True))
        results.append(((batch, channels, size, depth), rows))
    wall = time.perf_counter() - start
    after = machine_info(device)
    table = pivot(results, methods)
    versus = head_to_head(results, methods)
    print(table)
    print(versus)
    note = busy_machine_note(before, after, "Ratios are taken within one round-robin run per shape; "
                             "trust those where the wall ratio and the paired ratio (in brackets) agree.")
    hw = before.get("gpu") or before["cpu"]
    md = [
        "# revtrain vs plain PyTorch, checkpoint and the peer libraries",
        "",
        "Stack of additive coupling blocks, F and G = Conv3x3 (no bias) + BatchNorm + ReLU on half "
        "the channels; every method trains the same weights on the same batch in one process. Each "
        "cell: step time × plain autograd (median; paired per-round median in brackets), then the "
        "peak tensor memory of one step. Gradients of every method were checked against plain "
        "autograd before timing (relative L2 error in the JSON).",
        "",
        f"- command: `{command}`",
        f"- device: {before['device']} ({hw}), torch {before['torch']}, {before['torch_threads']} threads",
        f"- date: {before['date']}; wall time {wall:.0f} s; load average before {before['load_average']}, "
        f"after {after['load_average']}",
        f"- {repeats} timed steps per method and shape after {args.warmup} warm-up steps",
    ]
    md += [f"- {n}" for n in notes]
    if note:
        md += ["", f"**Note:** {note}"]
    coverage = median_interval([0.0] * repeats).coverage
    md += [
        "", table, "",
        "## Head to head",
        "",
        "Per-round ratios of the first method's step to the second's (both timed in the same "
        f"round): median [interval], over {repeats} rounds. The interval holds the true median "
        f"with probability {coverage:.1%} whatever the timings' distribution (order statistics; "
        "`revtrain.timing.median_interval`). Against a peer, *faster* / *slower*: the whole "
        "interval lies below / above 1; otherwise this run shows no difference.",
        "",
        versus,
        "",
    ]
    out = args.out if args.out is not None else ROOT / "results" / f"core_peers_{device.type}"
    payload = {
        "command": command, "machine": before, "machine_after": after, "wall_s": wall, "notes": notes,
        "shapes": [
            {"batch": b, "channels": c, "size": s, "depth": d, "rows": [r.to_dict() for r in rows],
             "paired": {k: v._asdict() for k, v in paired(rows, comparisons(methods)).items()}}
            for (b, c, s, d), rows in results
        ],
    }
    write_result(out, "\n".join(md), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
