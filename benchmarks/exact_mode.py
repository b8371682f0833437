"""Exact (fixed-point) couplings: rebuild drift with depth, and digits accuracy against float.

1. Drift: a stack of ``depth`` additive blocks (F, G = Linear(8, 8) + tanh, batch 16, float32),
   plain additive against exact (``fraction_bits=12``): the largest rebuild error of any block
   (``verify_invertible``), and whether M-mode gradients equal C-mode gradients bit for bit.
2. Digits: ``revnet38`` trained with the default recipe (benchmarks/digits_loop.py) in M-mode,
   float couplings against exact ones, over several seeds; test accuracy.

Its cost per step is the ``M-exact`` row of ``benchmarks/core_stack.py``.

    python benchmarks/exact_mode.py            # writes results/exact_mode_cpu.md/.json
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits_loop import train_digits  # noqa: E402

from revtrain import create_model  # noqa: E402
from revtrain.bench.machine import machine_info, machine_line  # noqa: E402
from revtrain.bench.results import write_result  # noqa: E402
from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes, use_exact_couplings, verify_invertible  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _stack(depth: int, coupling: str) -> ReversibleSequence:
    def fn() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    torch.manual_seed(0)
    return ReversibleSequence(
        [ReversibleBlock(fn(), fn(), coupling=coupling, check_reconstruction=False) for _ in range(depth)]
    )


def _grads(model: nn.Module, mode: str, x: torch.Tensor) -> list[torch.Tensor]:
    set_modes(model, mode)
    xg = x.clone().requires_grad_(True)
    g = torch.autograd.grad(model(xg).square().sum(), [xg, *model.parameters()])
    return [t.detach() for t in g]


def drift_rows(depths: list[int]) -> list[dict]:
    rows = []
    for depth in depths:
        for coupling in ("additive", "exact"):
            model = _stack(depth, coupling)
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
            report = verify_invertible(model, x, raise_on_failure=False)
            m, c = _grads(model, "M", x), _grads(model, "C", x)
            rel = max(float((a - b).norm() / b.norm()) for a, b in zip(m, c) if b.norm() > 0)
            rows.append({
                "depth": depth,
                "coupling": coupling,
                "max_rebuild_abs_error": max(ch.max_abs_error for ch in report.checks),
                "max_rebuild_rel_error": max(ch.rel_error for ch in report.checks),
                "grads_bitwise_equal": all(torch.equal(a, b) for a, b in zip(m, c)),
                "max_grad_rel_diff": rel,
            })
            print(rows[-1], flush=True)
    return rows


def digits_rows(seeds: list[int], epochs: int) -> list[dict]:
    rows = []
    for coupling in ("additive", "exact"):
        for seed in seeds:
            torch.manual_seed(seed)
            model = create_model("revnet38", num_classes=10, in_channels=1)
            if coupling == "exact":
                use_exact_couplings(model, fraction_bits=12)
            set_modes(model, "M")
            run = train_digits(model, seed=seed, epochs=epochs)
            rows.append({"coupling": coupling, "seed": seed, "test_accuracy": run.test_accuracy,
                         "final_train_loss": run.final_train_loss, "seconds": run.seconds})
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "exact_mode_cpu")
    args = parser.parse_args(argv)
    before = machine_info(torch.device("cpu"))
    start = time.perf_counter()
    drift = drift_rows(args.depths)
    digits = digits_rows(args.seeds, args.epochs)
    after = machine_info(torch.device("cpu"))
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    lines = [
        "# Exact (fixed-point) couplings",
        "",
        f"- command: `{command}`",
        machine_line(before, after, time.perf_counter() - start),
        "",
        "## Rebuild drift with depth (F, G = Linear(8, 8) + tanh, batch 16, float32)",
        "",
        "| depth | coupling | largest rebuild error (abs) | (rel) | M-mode grads == C-mode grads | largest ‖g_M − g_C‖/‖g_C‖ |",
        "|---:|:---|---:|---:|:---:|---:|",
    ]
    for r in drift:
        lines.append(
            f"| {r['depth']} | {r['coupling']} | {r['max_rebuild_abs_error']:.3g} | {r['max_rebuild_rel_error']:.3g} "
            f"| {'bit for bit' if r['grads_bitwise_equal'] else 'no'} | {r['max_grad_rel_diff']:.3g} |"
        )
    lines += [
        "",
        f"## Digits, revnet38, M-mode, {args.epochs} epochs (default recipe), seeds {args.seeds}",
        "",
        "| coupling | test accuracy per seed | mean | std | seconds per run |",
        "|:---|:---|---:|---:|---:|",
    ]
    for coupling in ("additive", "exact"):
        accs = [r["test_accuracy"] for r in digits if r["coupling"] == coupling]
        secs = [r["seconds"] for r in digits if r["coupling"] == coupling]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(
            f"| {coupling} | {', '.join(f'{a:.4f}' for a in accs)} | {statistics.mean(accs):.4f} | "
            f"{std:.4f} | {statistics.median(secs):.1f} |"
        )
    lines.append("")
    write_result(args.out, "\n".join(lines),
                 {"command": command, "machine": before, "machine_after": after, "drift": drift, "digits": digits})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
