"""What the rebuild check costs a whole training step of a zoo model, and what checking less saves.

One model in M-mode (RevNet-38 on 8×8 images of the registry's 3 channels, the default recipe's
size, unless told), whole SGD steps (forward, cross-entropy, backward, ``optimizer.step()``) with
the check set by
:func:`revtrain.core.set_rebuild_checks` (``revtrain train --check-every K``): on every step (1),
one step in each other interval given, and never (0). Each setting trains its own copy of the
model (the same initial weights), so each keeps its own count of steps. One step of each setting
per round, the order rotating. A setting that checks one step in ``K`` has cheap and dear steps,
so rounds are grouped in blocks of the least common multiple of the intervals, and each block's
total time per setting is divided by that of checking every step: the ratio of mean step times,
what training throughput sees, as a median over blocks with a distribution-free 95% interval
(``revtrain.timing.median_interval``). Gradients do not depend on the setting (a test:
``tests/core/test_rebuild_checks.py``). Writes
``results/check_cost_<model>_<side>x<side>_b<batch>_<device>.md`` and ``.json``.

    python benchmarks/check_cost.py                                  # RevNet-38, 8×8, batch 64
    python benchmarks/check_cost.py --model revnet110 --side 32 --batch 128 --rounds 60
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from revtrain.bench import machine_info
from revtrain.bench.results import write_result
from revtrain.bench.zoo_step import m_mode_image_model
from revtrain.core import set_rebuild_checks
from revtrain.device import resolve_device, synchronize
from revtrain.timing import block_ratios, median_interval

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="revnet38", help="a reversible image model of the zoo")
    parser.add_argument("--side", type=int, default=8, help="image side: 8 (digits) or 32 (CIFAR)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--every", type=int, nargs="+", default=[4, 0],
                        help="check intervals compared with checking every step (0: never)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per setting")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... or auto")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def run(model_name: str, side: int, batch_size: int, settings: list[int], rounds: int, warmup: int,
        device: torch.device) -> dict[int, list[float]]:
    """Wall seconds of one SGD step per setting, ``rounds`` rounds of one step each."""
    try:
        base, x, y = m_mode_image_model(model_name, side, batch_size, device)
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None
    sync = functools.partial(synchronize, device)
    steps = {}
    for every in settings:
        model = copy.deepcopy(base)
        set_rebuild_checks(model, every)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model=model, optimizer=optimizer) -> float:
            sync()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            sync()
            return time.perf_counter() - start

        steps[every] = step
    for every in settings:
        for _ in range(warmup):
            steps[every]()
    times: dict[int, list[float]] = {every: [] for every in settings}
    for r in range(rounds):
        k = r % len(settings)
        for every in settings[k:] + settings[:k]:
            times[every].append(steps[every]())
    return times


def _label(every: int) -> str:
    return "never (0)" if every == 0 else "every step (1)" if every == 1 else f"one step in {every}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if any(e < 0 for e in args.every):
        raise SystemExit("--every: intervals are integers >= 0 (0: never)")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"--device: {e}") from None
    if args.batch < 1 or args.side < 1:
        raise SystemExit("--batch and --side must be at least 1")
    settings = [1, *dict.fromkeys(e for e in args.every if e != 1)]
    block = math.lcm(*[e for e in settings if e > 0])
    if args.rounds < 2 * block:
        raise SystemExit(f"--rounds must be at least {2 * block}: two blocks of {block} rounds (the intervals' "
                         "least common multiple)")
    before = machine_info(device)
    start = time.perf_counter()
    times = run(args.model, args.side, args.batch, settings, args.rounds, args.warmup, device)
    wall = time.perf_counter() - start
    after = machine_info(device)
    rows = []
    for every in settings:
        ratio = median_interval(block_ratios(times[every], times[1], block)) if every != 1 else None
        rows.append({"every": every, "median_ms": statistics.median(times[every]) * 1e3,
                     "ratio": ratio._asdict() if ratio is not None else None})
    command = (shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None
               else shlex.join(["python", "benchmarks/check_cost.py", *argv]))
    coverage = median_interval([0.0] * (args.rounds // block)).coverage
    lines = [
        f"# The rebuild check's cost: {args.model}, {args.side}×{args.side}, batch {args.batch}, M-mode",
        "",
        "Whole SGD steps, each setting on its own copy of the model; one step of each setting per round (order "
        f"rotating); per block of {block} rounds, the setting's total time over checking every step's (the ratio of "
        f"mean step times): median [interval] over {args.rounds // block} blocks, the interval holding the true "
        f"median with probability {coverage:.1%}.",
        "",
        f"- command: `{command}`",
        f"- device: {before['device']} ({before.get('gpu', before.get('cpu', ''))}), torch {before['torch']}, "
        f"{before['torch_threads']} threads",
        f"- date: {before['date']}; {args.rounds} rounds, wall {wall:.0f} s; load average before "
        f"{before['load_average']}, after {after['load_average']}",
        "",
        "| rebuild check | median step | / every step |",
        "|:---|---:|---|",
    ]
    for row in rows:
        r = row["ratio"]
        cell = "–" if r is None else f"{r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"
        lines.append(f"| {_label(row['every'])} | {row['median_ms']:.1f} ms | {cell} |")
    text = "\n".join(lines) + "\n"
    print(text)
    name = f"check_cost_{args.model}_{args.side}x{args.side}_b{args.batch}_{device.type}"
    out = args.out if args.out is not None else ROOT / "results" / name
    write_result(out, text, {
        "command": command, "machine": before, "machine_after": after, "wall_s": wall, "model": args.model,
        "side": args.side, "batch": args.batch, "rounds": args.rounds, "block": block, "rows": rows,
        "times_s": {str(k): v for k, v in times.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
