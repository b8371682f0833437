"""How small a rebuild error the check reports, in every direction, against the old norm check.

For a half shaped like the core benchmark's (batch 32, 32 channels, 32x32; a view split off a
64-channel tensor, as a block sees it), adds an error ``e`` of relative size ``δ = ‖e‖/‖x‖`` in
one of several directions and asks both checks whether ``x + e`` differs from ``x`` by more than
the default ``drift_tolerance`` (1e-3):

- the check of ``revtrain.core.checks`` (norm + 4 random projections, relative floor);
- the norm-only check it replaced (``|‖x+e‖ - ‖x‖| / ‖x‖``).

Directions: ``random`` (i.i.d. noise), ``rotation`` (norm-preserving: x turned towards an
orthogonal direction), ``one sample`` (noise in one batch element), ``one entry``, ``channel
offset`` (the same value added to a whole channel, every sample). Each cell is the share of
``--trials`` draws (fresh ``x`` and ``e``) reported. Also times one fingerprint of such a half.

    python benchmarks/rebuild_check.py                 # writes results/rebuild_check_cpu.md/.json
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from revtrain.bench.machine import machine_info, machine_line
from revtrain.bench.results import write_result
from revtrain.core import ReversibleBlock
from revtrain.core.checks import RebuildCheck, check_rebuilds
from revtrain.core.fingerprint import fingerprint, layout_of

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("random", "rotation", "one sample", "one entry", "channel offset")
SIZES = (1e-4, 3e-4, 1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 3e-2, 1e-1)
TOLERANCE = 1e-3


def _error(x: torch.Tensor, kind: str, size: float, gen: torch.Generator) -> torch.Tensor:
    if kind == "rotation":
        w = torch.randn(x.shape, generator=gen)
        w = w - (w * x).sum() / x.square().sum() * x
        theta = 2 * math.asin(size / 2)  # a chord of length size·‖x‖
        return x * (math.cos(theta) - 1) + w * (x.norm() / w.norm()) * math.sin(theta)
    if kind == "random":
        e = torch.randn(x.shape, generator=gen)
    elif kind == "one sample":
        e = torch.zeros_like(x)
        e[int(torch.randint(0, x.shape[0], (1,), generator=gen))] = torch.randn(x.shape[1:], generator=gen)
    elif kind == "one entry":
        e = torch.zeros_like(x).flatten()
        e[int(torch.randint(0, e.numel(), (1,), generator=gen))] = 1.0
        e = e.view_as(x)
    else:
        e = torch.randn(1, x.shape[1], 1, 1, generator=gen).expand_as(x).contiguous()
    return size * x.norm() * e / e.norm()


def _reported(x1: torch.Tensor, x2: torch.Tensor, e: torch.Tensor) -> tuple[bool, bool, float]:
    """(new check reports, norm check reports, new check's estimate / true error)."""
    # The real check, asked for its estimate only (an infinite tolerance never warns).
    layer = ReversibleBlock(torch.nn.Identity(), torch.nn.Identity(), drift_tolerance=math.inf)
    layout = layout_of((x1, x2))  # the rebuild is compared in the original's layout
    before = fingerprint((x1, x2), layout)
    after = fingerprint((x1 + e, x2), layout)
    out = before[:, 0]  # output scale: like the input's (an additive block roughly keeps it)
    (drift,) = check_rebuilds([RebuildCheck(layer, "x", before, after, out)])
    true = float(e.norm() / x1.norm())
    norm_drift = abs(float((x1 + e).norm()) - float(x1.norm())) / float(x1.norm())
    return drift > TOLERANCE, norm_drift > TOLERANCE, drift / true if true > 0 else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--entries", type=int, default=300,
                        help="single entries for the one-entry calibration (the table's draws reuse 20 positions)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "rebuild_check_cpu")
    args = parser.parse_args(argv)
    info = machine_info(torch.device("cpu"))
    start = time.perf_counter()
    table: dict[str, dict[str, tuple[float, float]]] = {}
    ratios: dict[str, list[float]] = {}
    for kind in KINDS:
        table[kind] = {}
        ratios[kind] = []
        for size in SIZES:
            new = old = 0
            for trial in range(args.trials):
                gen = torch.Generator().manual_seed(1000 * trial + 7)
                full = torch.randn(32, 64, 32, 32, generator=gen)
                x1, x2 = full.chunk(2, dim=1)
                e = _error(x1, kind, size, gen)
                n, o, r = _reported(x1, x2, e)
                new += n
                old += o
                ratios[kind].append(r)
            table[kind][f"{size:g}"] = (new / args.trials, old / args.trials)
        print(kind, {k: v[0] for k, v in table[kind].items()}, flush=True)

    # One-entry errors: the estimate is that entry's weight in the random vectors, so its spread
    # shows only over many entries (the table's trials reuse one position per trial for every δ).
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(32, 64, 32, 32, generator=gen)
    x1, x2 = full.chunk(2, dim=1)
    entry_ratios = sorted(_reported(x1, x2, _error(x1, "one entry", 1e-2, gen))[2] for _ in range(args.entries))
    q = lambda f: entry_ratios[int(f * (len(entry_ratios) - 1))]  # noqa: E731
    entry_line = (f"One entry, {args.entries} random positions at δ = 1e-2: estimate / true error median "
                  f"{q(0.5):.2f}, 5th percentile {q(0.05):.2f}, 95th {q(0.95):.2f}; reported "
                  f"{sum(r * 1e-2 > TOLERANCE for r in entry_ratios) / len(entry_ratios):.0%}.")
    print(entry_line, flush=True)

    full = torch.randn(32, 64, 32, 32)
    x1, x2 = full.chunk(2, dim=1)
    times = []
    for _ in range(30):
        t = time.perf_counter()
        fingerprint((x1, x2), layout_of((x1, x2)))
        times.append(time.perf_counter() - t)
    fp_ms = statistics.median(times[5:]) * 1e3
    norms = []
    for _ in range(30):
        t = time.perf_counter()
        torch.stack([torch.linalg.vector_norm(x1), torch.linalg.vector_norm(x2)]).tolist()
        norms.append(time.perf_counter() - t)
    norm_ms = statistics.median(norms[5:]) * 1e3

    after = machine_info(torch.device("cpu"))
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    lines = [
        "# Rebuild check: smallest error reported, by direction",
        "",
        f"Share of {args.trials} draws reported at drift_tolerance={TOLERANCE:g}, for an error of "
        "relative size δ = ‖e‖/‖x1‖ added to half x1 of a (32, 64, 32, 32) float32 input split "
        "in halves (views). Each cell: new check (64 random projections) / old norm-only "
        "check.",
        "",
        f"- command: `{command}`",
        machine_line(info, after, time.perf_counter() - start),
        f"- one fingerprint of both halves: {fp_ms:.2f} ms median (the norm-only fingerprint: "
        f"{norm_ms:.2f} ms)",
        "",
        "| δ | " + " | ".join(KINDS) + " |",
        "|---:|" + "---:|" * len(KINDS),
    ]
    for size in SIZES:
        cells = [f"{table[k][f'{size:g}'][0]:.2f} / {table[k][f'{size:g}'][1]:.2f}" for k in KINDS]
        lines.append(f"| {size:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Estimated / true relative error over all draws (the check's calibration): "
        + ", ".join(
            f"{k}: median {statistics.median(ratios[k]):.2f}, 5th pct "
            f"{sorted(ratios[k])[len(ratios[k]) // 20]:.2f}"
            for k in KINDS
        ),
        "",
        entry_line,
        "",
    ]
    write_result(args.out, "\n".join(lines), {
        "command": command, "machine": info, "machine_after": after, "tolerance": TOLERANCE,
        "reported_new_old": table, "fingerprint_ms": fp_ms, "norm_ms": norm_ms, "one_entry_ratios": entry_ratios})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
