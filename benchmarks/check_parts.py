"""Where the rebuild check's time goes inside a training step, part by part.

Whole SGD steps of one M-mode zoo model (RevNet-38 on 8×8 images of the registry's 3 channels,
the default recipe's size, unless told) with the check on all reversible layers, on one layer
only, or on none; the check's entry points
(forward: ``Fingerprints.add`` and ``stacked``; backward: ``RunCheck`` creation, ``add`` and
``finish``) and the functions inside them are wrapped with wall-clock timers, so each part's
microseconds per step are its cost *inside* a step. Parts nest (``fwd add`` holds
``products``), so the rows do not add up. One more row times the quick screen of ``finish``
(``_all_within``, a few numpy ops) twice in a row: the first call pays for caches that the
step's kernels left cold, the second shows what the same work costs warm. Writes
``results/check_parts_<model>_<side>x<side>_b<batch>_<device>.md`` and ``.json``.

    python benchmarks/check_parts.py                     # RevNet-38, 8×8, batch 64, CPU
    python benchmarks/check_parts.py --checked none 3 all --steps 100
"""

from __future__ import annotations

import argparse
import collections
import copy
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import revtrain.core.checks as checks
import revtrain.core.fingerprint as fingerprint
from revtrain.bench import machine_info
from revtrain.bench.results import write_result
from revtrain.bench.zoo_step import m_mode_image_model
from revtrain.core import reversible_blocks

ROOT = Path(__file__).resolve().parent.parent

PARTS: tuple[tuple[Any, str, str], ...] = (
    (fingerprint.Fingerprints, "add", "forward: Fingerprints.add (per state)"),
    (fingerprint, "_products", "  products of the state's halves"),
    (fingerprint.Fingerprints, "stacked", "forward: Fingerprints.stacked (per run)"),
    (fingerprint, "_fold_rows", "  fold"),
    (checks.RunCheck, "__init__", "backward: RunCheck() (per run)"),
    (checks.RunCheck, "add", "backward: RunCheck.add (per rebuilt state)"),
    (checks, "row_projections", "  products of the rebuilt halves"),
    (checks.RunCheck, "_compare_waiting", "  comparisons (per group of states)"),
    (checks.RunCheck, "finish", "backward: RunCheck.finish (per run)"),
    (checks, "_on_host", "  verdicts to the host"),
)
"""(owner, attribute, label) of each timed part, in the order a step meets them (labels unique)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="revnet38", help="a reversible image model of the zoo")
    parser.add_argument("--side", type=int, default=8, help="image side: 8 (digits) or 32 (CIFAR)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--checked", nargs="+", default=["none", "0", "all"],
                        help="which reversible layers check: 'all', 'none', or one layer's index")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


class _Timers:
    """Wall-clock totals of wrapped functions, restored on exit."""

    def __init__(self) -> None:
        self.totals: collections.Counter[str] = collections.Counter()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def screen_twice(self) -> None:
        """``_all_within`` run twice per call: the first call's time and the second's."""
        original = checks._all_within
        totals = self.totals

        def twice(*args: Any) -> bool:
            start = time.perf_counter()
            result = original(*args)
            middle = time.perf_counter()
            original(*args)
            totals["  quick screen, first call"] += middle - start
            totals["  quick screen, same call again"] += time.perf_counter() - middle
            return result

        self._undo.append((checks, "_all_within", original))
        checks._all_within = twice

    def __enter__(self) -> _Timers:
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _setting(base: torch.nn.Module, checked: str) -> tuple[torch.nn.Module, int]:
    model = copy.deepcopy(base)
    layers = [layer for _, layer in reversible_blocks(model)]
    if checked not in ("all", "none"):
        index = int(checked)
        if not 0 <= index < len(layers):
            raise SystemExit(f"--checked: the model has {len(layers)} reversible layers; {index} is not one")
    for i, layer in enumerate(layers):
        layer.check_reconstruction = checked == "all" or (checked != "none" and i == int(checked))
        layer.check_every = 1
    return model, sum(layer.check_reconstruction for layer in layers)


def measure(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, checked: str, steps: int,
            warmup: int) -> dict:
    """Per-part microseconds per step and the whole step's milliseconds for one setting."""
    model, count = _setting(base, checked)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    with _Timers() as timers:
        for owner, name, label in PARTS:
            timers.wrap(owner, name, label)
        timers.screen_twice()
        for _ in range(warmup):
            step()
        timers.totals.clear()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
    return {"checked": checked, "layers_checked": count, "step_ms": wall / steps * 1e3,
            "parts_us": {label: timers.totals[label] / steps * 1e6 for label in _labels()}}


def _labels() -> list[str]:
    return [label for _, _, label in PARTS] + ["  quick screen, first call", "  quick screen, same call again"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.side < 1:
        raise SystemExit("--steps, --batch and --side must be at least 1")
    for checked in args.checked:
        if checked not in ("all", "none") and not checked.isdigit():
            raise SystemExit(f"--checked: 'all', 'none' or a layer index, got {checked!r}")
    try:
        base, x, y = m_mode_image_model(args.model, args.side, args.batch)
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None
    before = machine_info(torch.device("cpu"))
    rows = [measure(base, x, y, checked, args.steps, args.warmup) for checked in args.checked]
    after = machine_info(torch.device("cpu"))
    command = (shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None
               else shlex.join(["python", "benchmarks/check_parts.py", *argv]))
    lines = [
        f"# The rebuild check's parts inside a step: {args.model}, {args.side}×{args.side}, batch {args.batch}, M-mode",
        "",
        f"Microseconds per whole SGD step ({args.steps} steps after {args.warmup}) spent in each part, timed where "
        "it runs; indented parts are inside the part above them. The timers themselves add a few microseconds "
        "per call.",
        "",
        f"- command: `{command}`",
        f"- device: cpu ({before.get('cpu', '')}), torch {before['torch']}, {before['torch_threads']} threads",
        f"- date: {before['date']}; load average before {before['load_average']}, after {after['load_average']}",
        "",
        "| part | " + " | ".join(f"{r['layers_checked']} layer(s) checked ({r['checked']})" for r in rows) + " |",
        "|:---|" + "---:|" * len(rows),
        "| whole step | " + " | ".join(f"{r['step_ms']:.1f} ms" for r in rows) + " |",
    ]
    for label in _labels():
        lines.append(f"| {label.strip() if not label.startswith('  ') else '· ' + label.strip()} | "
                     + " | ".join(f"{r['parts_us'][label]:.0f} µs" for r in rows) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    name = f"check_parts_{args.model}_{args.side}x{args.side}_b{args.batch}_cpu"
    out = args.out if args.out is not None else ROOT / "results" / name
    write_result(out, text, {"command": command, "machine": before, "machine_after": after, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
