"""Which product should take a fingerprint's row projections on a CUDA GPU: device time and host
time per call, for halves of several shapes.

The rebuild check reads each state once: ``W = X u``, every row of a half against two random
vectors (``core/fingerprint.py``; the CPU's in-step comparison is
``benchmarks/fingerprint_products.py``). Two ways, with the library's own vectors:

- ``batched``: ``torch.bmm(X, u)``, a product with two columns;
- ``transposed``: ``torch.bmm(u^T, X^T)``, two rows against the data.

Device time: CUDA events around 50 calls in a row. Host time: 200 calls without a sync (on
large halves the device sets the pace there too). Relative error against a float64 product.
Writes ``results/fingerprint_products_cuda.md`` and ``.json``.

    python benchmarks/fingerprint_products_cuda.py
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from revtrain.bench.machine import machine_info
from revtrain.bench.results import write_result
from revtrain.core import fingerprint as fp

ROOT = Path(__file__).resolve().parent.parent

HALF_SHAPES = ((8, 8, 8, 8), (32, 32, 32, 32), (64, 64, 16, 16), (128, 128, 32, 32), (256, 128, 32, 32))
"""Batch, channels, height, width of one half."""


def products(slab: torch.Tensor, plan: fp._Plan) -> dict:
    u = plan.u
    u_t = u.transpose(1, 2).contiguous()  # type: ignore[union-attr]
    return {
        "batched": lambda: torch.bmm(slab, u),
        "transposed": lambda: torch.bmm(u_t, slab.transpose(1, 2)).transpose(1, 2),
    }


def measure(shape: tuple[int, int, int, int], device: torch.device) -> dict:
    x = torch.randn(shape, device=device)
    plan = fp._Plan.of(x, 2)
    slab = fp._slab(x, plan)
    reference = torch.bmm(slab.double(), plan.u.double())  # type: ignore[union-attr]
    row = {"half": list(shape), "slab": list(plan.shape), "megabytes": x.numel() * 4 / 1e6}
    for name, fn in products(slab, plan).items():
        for _ in range(5):
            w = fn()
        error = float((w.double() - reference).norm() / reference.norm())
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        device_us = start.elapsed_time(end) * 1e3 / 50
        t = time.perf_counter()
        for _ in range(200):
            fn()
        host_us = (time.perf_counter() - t) * 1e6 / 200
        torch.cuda.synchronize(device)
        row[name] = {"device_us": device_us, "host_us": host_us, "rel_error": error}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fingerprint_products_cuda")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise SystemExit(f"--device: {e}") from None
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"this benchmark times CUDA products; --device {args.device!r} is not an available CUDA device "
                         "(the CPU's comparison is benchmarks/fingerprint_products.py)")
    info = machine_info(device)
    rows = [measure(shape, device) for shape in HALF_SHAPES]
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(
        ["python", "benchmarks/fingerprint_products_cuda.py", *argv])
    lines = [
        "# Fingerprint row projections on a CUDA GPU",
        "",
        "Device µs per product (CUDA events over 50 calls), host µs per call (200 calls), relative "
        "error against float64; float32 halves, the library's vectors. The third column is the time "
        "to read the half once at 3 TB/s, whatever the GPU.",
        "",
        f"- command: `{command}`",
        f"- device: {info['device']} ({info.get('gpu')}), torch {info['torch']}",
        f"- date: {info['date']}",
        "",
        "| half (B, C, H, W) | MB | one read at 3 TB/s (an H100's HBM3), µs | batched device / host µs | transposed device / host µs | error batched / transposed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, t = r["batched"], r["transposed"]
        lines.append(
            f"| {tuple(r['half'])} | {r['megabytes']:.1f} | {r['megabytes'] / 3.0e3 * 1e3:.1f} | "
            f"{b['device_us']:.1f} / {b['host_us']:.1f} | {t['device_us']:.1f} / {t['host_us']:.1f} | "
            f"{b['rel_error']:.1e} / {t['rel_error']:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    write_result(args.out, text, {"command": command, "machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
