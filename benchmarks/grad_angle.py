"""RevNet §5.2 / Fig. 4 in kind: the angle between stored- and rebuilt-activation gradients
over training, with :func:`revtrain.train.grad_angle.gradient_angles`.

1. ``revnet38`` on the digits (the default job's model and recipe, float32, M-mode), the angle
   measured every ``--every`` steps on the training batch about to be used.
2. A deep float32 stack on the digits (stem conv to 16 channels, ``--depth`` coupling blocks of
   ReLU + Conv3x3 + BatchNorm (zero-initialised scale: each block starts as the identity) on 8
   channels, pooling, linear head; peak lr ``--deep-lr``),
   additive and affine couplings, and the exact coupling as the control (its angle must be 0).

Writes one PNG per run (angle and relative error per parameter group over the steps) and a
markdown summary to ``results/``.

    python benchmarks/grad_angle.py
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits_loop import train_digits  # noqa: E402

from revtrain import create_model  # noqa: E402
from revtrain.bench.machine import machine_info, machine_line  # noqa: E402
from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes  # noqa: E402
from revtrain.train.grad_angle import gradient_angles, plot_grad_angles  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def deep_stack(depth: int, coupling: str) -> nn.Module:
    mult = 2 if coupling == "affine" else 1

    def fn() -> nn.Module:
        # Pre-activation, last norm scaled to zero: every block starts as the identity (64
        # affine scales of up to e^2 each would overflow float32 at initialisation).
        norm = nn.BatchNorm2d(8 * mult)
        nn.init.zeros_(norm.weight)
        return nn.Sequential(nn.ReLU(), nn.Conv2d(8, 8 * mult, 3, padding=1, bias=False), norm)

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        ReversibleSequence([ReversibleBlock(fn(), fn(), coupling=coupling, check_reconstruction=False) for _ in range(depth)]),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def run(
    name: str, model: nn.Module, *, epochs: int, every: int, seed: int, group_depth: int, out: Path, lr: float
) -> dict:
    set_modes(model, "M")
    records: list[dict] = []

    def monitor(step: int, m: nn.Module, batch) -> None:
        if step % every == 0:
            result = gradient_angles(m, batch, nn.functional.cross_entropy, group_depth=group_depth)
            records.append({"event": "grad_angle", "step": step, **result.to_record()})

    try:
        trained = train_digits(model, seed=seed, epochs=epochs, on_step=monitor, lr=lr)
        accuracy, steps, note = trained.test_accuracy, trained.steps, ""
    except FloatingPointError as err:  # diverged: keep the angles measured until then
        accuracy, steps, note = float("nan"), records[-1]["step"] if records else 0, str(err)
    png = plot_grad_angles(records, out.parent / f"{out.name}_{name}.png", title=f"{name}: stored vs rebuilt activations")
    overall = [r["groups"]["all"] for r in records]
    summary = {
        "run": name,
        "steps": steps,
        "measurements": len(records),
        "test_accuracy": accuracy,
        "note": note,
        "angle_first_deg": overall[0]["angle_deg"],
        "angle_last_deg": overall[-1]["angle_deg"],
        "angle_max_deg": max(o["angle_deg"] for o in overall),
        "rel_error_max": max(o["rel_error"] for o in overall),
        "plot": str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png),
        "records": records,
    }
    print({k: v for k, v in summary.items() if k != "records"}, flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=5, help="measure every this many steps")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--depth", type=int, default=64, help="blocks of the deep stack")
    parser.add_argument("--deep-epochs", type=int, default=5)
    parser.add_argument("--deep-lr", type=float, default=0.01, help="peak lr of the deep stacks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="CPU threads (1: these small tensors run fastest alone; 2 threads on a shared machine stall)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "grad_angle")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    before = machine_info(torch.device("cpu"))
    start = time.perf_counter()
    runs = []
    torch.manual_seed(args.seed)
    runs.append(run("revnet38-digits", create_model("revnet38", num_classes=10, in_channels=1),
                    epochs=args.epochs, every=args.every, seed=args.seed, group_depth=2, out=args.out, lr=0.1))
    for coupling in ("additive", "affine", "exact"):
        torch.manual_seed(args.seed)
        runs.append(run(f"deep{args.depth}-{coupling}", deep_stack(args.depth, coupling), epochs=args.deep_epochs,
                        every=args.every, seed=args.seed, group_depth=1, out=args.out, lr=args.deep_lr))
    after = machine_info(torch.device("cpu"))
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    lines = [
        "# Gradient angle: stored vs rebuilt activations over training (RevNet §5.2, Fig. 4)",
        "",
        "Angle between the gradient with stored activations (every reversible block in C-mode) "
        "and with rebuilt ones (M-mode), on the training batch, every "
        f"{args.every} steps, float32, digits, default recipe (benchmarks/digits_loop.py).",
        "",
        f"- command: `{command}`",
        machine_line(before, after, time.perf_counter() - start),
        "",
        "| run | steps | angle at step 0 (deg) | last (deg) | max (deg) | max ‖g_M − g_C‖/‖g_C‖ | test accuracy | plot |",
        "|:---|---:|---:|---:|---:|---:|---:|:---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['angle_first_deg']:.3g} | {r['angle_last_deg']:.3g} | "
            f"{r['angle_max_deg']:.3g} | {r['rel_error_max']:.3g} | {r['test_accuracy']:.4f} | `{r['plot']}` |"
        )
    lines += [f"- {r['run']}: {r['note']}" for r in runs if r["note"]]
    lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = args.out.parent / f"{args.out.name}_cpu.md"
    md.write_text("\n".join(lines))
    (args.out.parent / f"{args.out.name}_cpu.json").write_text(
        json.dumps({"command": command, "machine": before, "machine_after": after, "runs": runs}, indent=2) + "\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
