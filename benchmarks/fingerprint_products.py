"""Which product should take a fingerprint's row projections on the CPU, measured inside a step.

The rebuild check reads each state once: ``W = X u``, every row of a half against two random
vectors (``core/fingerprint.py``). Three ways to compute it, timed where it runs:

- ``batched``: ``torch.bmm(X, u)``, a product with two columns;
- ``transposed``: ``torch.bmm(u^T, X^T)``, two rows against the data (the library's choice
  for CPU tensors from 32K values);
- ``complex``: the rows seen as complex numbers times one complex vector, summed, in chunks of
  1 MiB (the library's choice before; kept here as the reference it was measured against).

Part 1 (per product): the extra time of one product right after the state is computed
(``y = x + conv(x)``, as a block's coupling does), paired against the same code without it,
for halves of several shapes. Part 2 (whole steps): M-mode steps of the core stack (F, G =
Conv3x3 + BN + ReLU) with the library's row projections swapped for each of the three, in
rounds, as paired ratios against ``transposed``.

    python benchmarks/fingerprint_products.py      # writes results/fingerprint_products_cpu.md/.json
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from revtrain.bench.machine import machine_info, machine_line
from revtrain.bench.results import write_result
from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.core import fingerprint as fp

ROOT = Path(__file__).resolve().parent.parent

PRODUCT_SHAPES = ((8, 16, 8), (64, 32, 8), (16, 64, 16), (64, 16, 32), (8, 128, 32), (32, 64, 32))
"""Batch, channels (of the whole state; a half has half of them), side."""

STEP_SHAPES = ((8, 16, 8, 16), (64, 32, 8, 16), (16, 64, 16, 16), (64, 16, 32, 8), (32, 64, 32, 16))
"""Batch, channels, side, depth of the core stacks timed whole."""

_CHUNK = 1 << 17  # complex values per chunk of the complex product


def batched(slab: Tensor, plan: fp._Plan) -> Tensor:
    return torch.bmm(slab, plan.u)  # type: ignore[arg-type]


def transposed(slab: Tensor, plan: fp._Plan) -> Tensor:
    a, _, length = plan.shape
    u_t = _transposed_vectors(plan, a, length)
    return torch.bmm(u_t, slab.transpose(1, 2)).transpose(1, 2)


def complex_sum(slab: Tensor, plan: fp._Plan) -> Tensor:
    """The complex multiply-and-sum the library used before (even row lengths only)."""
    a, r, length = plan.shape
    cu = _complex_vector(plan, length)
    xc = torch.view_as_complex(slab.reshape(a, r, length // 2, 2))
    out = torch.empty((a, r), dtype=cu.dtype)
    rows = max(1, _CHUNK // (length // 2))
    if a * r <= rows:
        torch.sum(xc * cu, dim=-1, out=out)
    elif r <= rows:
        step = rows // r
        for i in range(0, a, step):
            torch.sum(xc[i : i + step] * cu, dim=-1, out=out[i : i + step])
    else:
        for i in range(a):
            for j in range(0, r, rows):
                torch.sum(xc[i, j : j + rows] * cu, dim=-1, out=out[i, j : j + rows])
    return torch.view_as_real(out)


METHODS: dict[str, Callable[[Tensor, fp._Plan], Tensor]] = {
    "batched": batched, "transposed": transposed, "complex": complex_sum,
}

_cache: dict[tuple, Tensor] = {}  # by slab shape and dtype (the random vectors depend on nothing else)


def _transposed_vectors(plan: fp._Plan, a: int, length: int) -> Tensor:
    key = (plan.shape, plan.u.dtype, "t")  # type: ignore[union-attr]
    if key not in _cache:
        _cache[key] = plan.u[0].T.contiguous().expand(a, 2, length)  # type: ignore[index]
    return _cache[key]


def _complex_vector(plan: fp._Plan, length: int) -> Tensor:
    key = (plan.shape, plan.u.dtype, "c")  # type: ignore[union-attr]
    if key not in _cache:
        u = plan.u[0]  # type: ignore[index]
        _cache[key] = torch.complex(u[0::2, 0], u[0::2, 1]).to(torch.complex64 if u.dtype == torch.float32 else torch.complex128)
    return _cache[key]


def _fn(c: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())


def per_product(batch: int, channels: int, side: int, rounds: int, calls: int | None = None) -> dict:
    """Extra µs of one product after ``y = x + conv(x)`` (paired medians over rounds)."""
    torch.manual_seed(0)
    conv = _fn(channels // 2)
    x = torch.randn(batch, channels // 2, side, side)
    plan = fp._Plan.of(x, fp.layout_of([x])[0])
    shape = plan.shape

    def run(method: Callable | None) -> None:
        with torch.no_grad():
            y = x + conv(x)
            if method is not None:
                method(y.view(shape), plan)

    for method in METHODS.values():  # same values first
        torch.testing.assert_close(method(x.view(shape), plan), batched(x.view(shape), plan), rtol=1e-4, atol=1e-3)
    calls = calls or max(3, int(4e6 / x.numel() / 8))
    cases: dict[str, Callable | None] = {"none": None, **METHODS}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for method in cases.values():
        for _ in range(3):
            run(method)
    for _ in range(rounds):
        for name, method in cases.items():
            start = time.perf_counter()
            for _ in range(calls):
                run(method)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    extra = {k: statistics.median(a - b for a, b in zip(times[k], times["none"])) for k in METHODS}
    return {"shape": [batch, channels, side], "slab": list(shape), "values": x.numel(),
            "step_us": statistics.median(times["none"]), "extra_us": extra}


def whole_steps(batch: int, channels: int, side: int, depth: int, rounds: int, reps: int | None = None) -> dict:
    """M-mode steps with each product in place of the library's, paired against transposed."""
    torch.manual_seed(0)
    model = ReversibleSequence([ReversibleBlock(_fn(channels // 2), _fn(channels // 2)) for _ in range(depth)])
    x = torch.randn(batch, channels, side, side, requires_grad=True)
    library = fp._row_projections

    def step() -> None:
        model(x).square().mean().backward()

    def use(method: Callable) -> Callable:
        def projections(slab: Tensor, plan: fp._Plan) -> Tensor:
            if slab.numel() < fp._TRANSPOSED_MIN or (method is complex_sum and plan.shape[2] % 2):
                return batched(slab, plan)  # what the library does below 32K values
            return method(slab, plan)
        return projections

    variants = {name: use(method) for name, method in METHODS.items()}
    reps = reps or max(2, int(2e6 / (x.numel() * depth)))
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for variant in variants.values():
            fp._row_projections = variant
            step()
            step()
        for _ in range(rounds):
            for name, variant in variants.items():
                fp._row_projections = variant
                start = time.perf_counter()
                for _ in range(reps):
                    step()
                times[name].append((time.perf_counter() - start) / reps * 1e3)
    finally:
        fp._row_projections = library
    return {
        "shape": [batch, channels, side, depth], "steps_per_round": reps,
        "step_ms": {k: statistics.median(v) for k, v in times.items()},
        "paired_vs_transposed": {k: statistics.median(a / b for a, b in zip(v, times["transposed"])) for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21, help="rounds of part 1")
    parser.add_argument("--step-rounds", type=int, default=11, help="rounds of part 2")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fingerprint_products_cpu")
    args = parser.parse_args(argv)
    info = machine_info(torch.device("cpu"))
    start = time.perf_counter()
    products = []
    for shape in PRODUCT_SHAPES:
        products.append(per_product(*shape, rounds=args.rounds))
        print(products[-1], flush=True)
    steps = []
    for shape in STEP_SHAPES:
        steps.append(whole_steps(*shape, rounds=args.step_rounds))
        print(steps[-1], flush=True)
    after = machine_info(torch.device("cpu"))
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    lines = [
        "# Fingerprint products on the CPU, inside a step",
        "",
        "Row projections `W = X u` of one half (`core/fingerprint.py`) by three products: batched "
        "`bmm(X, u)`, transposed `bmm(u^T, X^T)` (the library's choice from 32K values), and the "
        "complex multiply-and-sum in 1 MiB chunks the library used before.",
        "",
        f"- command: `{command}`",
        machine_line(info, after, time.perf_counter() - start),
        "",
        "## Part 1: one product right after the state is computed",
        "",
        f"Extra µs over `y = x + conv(x)` alone (paired medians of {args.rounds} rounds; small "
        "differences are noise where the step itself is long).",
        "",
        "| batch × ch × side | half as (A, R, L) | values | y = x + conv(x) | batched | transposed | complex |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in products:
        b, c, s = row["shape"]
        e = row["extra_us"]
        lines.append(f"| {b} × {c} × {s}² | {tuple(row['slab'])} | {row['values']} | {row['step_us']:.0f} µs | "
                     f"{e['batched']:.1f} | {e['transposed']:.1f} | {e['complex']:.1f} |")
    lines += [
        "",
        "## Part 2: whole M-mode steps of the core stack",
        "",
        f"Step time with each product, paired ratio against `transposed` (medians of {args.step_rounds} "
        "rounds; halves below 32K values take the batched product in all three, so the first row, whose "
        "halves are all smaller, shows the noise).",
        "",
        "| batch × ch × side, depth | transposed step | batched / transposed | complex / transposed |",
        "|---|---:|---:|---:|",
    ]
    for row in steps:
        b, c, s, d = row["shape"]
        p = row["paired_vs_transposed"]
        lines.append(f"| {b} × {c} × {s}², {d} | {row['step_ms']['transposed']:.1f} ms | {p['batched']:.3f} | {p['complex']:.3f} |")
    write_result(args.out, "\n".join(lines) + "\n",
                 {"command": command, "machine": info, "machine_after": after, "products": products, "steps": steps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
