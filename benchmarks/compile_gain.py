"""What ``revtrain train --compile`` gains on this machine: two short runs, eager then compiled.

Runs ``revtrain train`` twice in fresh processes with the same seed (default: RevNet-38 on the
digits, 4 epochs, M-mode), reads each run's ``metrics.jsonl`` and writes
``results/compile_<device>.md``: training time and samples/s per epoch, the steady-state gain
(epochs after the first) and the compilation time, estimated as the compiled run's first epoch
minus its steady epoch time (the first steps pay the compilation).

    python benchmarks/compile_gain.py                       # revnet38, digits, 4 epochs
    python benchmarks/compile_gain.py --epochs 3 --model resnet32
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from revtrain.bench import machine_info, resolve_device

ROOT = Path(__file__).resolve().parent.parent


def _epochs(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r.get("event") == "epoch" or "epoch_train_time_s" in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="revnet38")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--mode", default="M", choices=["M", "C"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="results path without suffix")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    scratch = ROOT / "results" / "tmp" / f"compile_{int(time.time())}"
    before = machine_info(device)
    runs = {}
    for label, flag in (("eager", "--no-compile"), ("compiled", "--compile")):
        run_dir = scratch / label
        cmd = [sys.executable, "-m", "revtrain.cli", "train", "--model", args.model, "--epochs", str(args.epochs),
               "--mode", args.mode, "--device", args.device, flag, "--run-dir", str(run_dir)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        runs[label] = (time.perf_counter() - start, _epochs(run_dir))
    after = machine_info(device)
    lines = [
        "# torch.compile on the training loop",
        "",
        f"`revtrain train --model {args.model} --epochs {args.epochs} --mode {args.mode} --device {args.device}`, "
        "eager (`--no-compile`) then `--compile`, fresh processes, same seed.",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- device: {before['device']} ({before.get('gpu') or before['cpu']}), torch {before['torch']}, "
        f"{before['torch_threads']} threads",
        f"- date: {before['date']}; load average before {before['load_average']}, after {after['load_average']}",
        "",
        "| run | process wall s | epoch 1 train s | later epochs train s (median) | samples/s (later epochs) | test acc. (last) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    steady = {}
    for label, (wall, epochs) in runs.items():
        later = [e["epoch_train_time_s"] for e in epochs[1:]] or [epochs[0]["epoch_train_time_s"]]
        rate = statistics.median(e["samples_per_s"] for e in epochs[1:] or epochs)
        steady[label] = statistics.median(later)
        acc = epochs[-1].get("test_accuracy", epochs[-1].get("test_acc", float("nan")))
        lines.append(f"| {label} | {wall:.1f} | {epochs[0]['epoch_train_time_s']:.2f} | {steady[label]:.2f} | "
                     f"{rate:.0f} | {acc:.4f} |")
    first_compiled = runs["compiled"][1][0]["epoch_train_time_s"]
    lines += [
        "",
        f"Steady-state gain: eager / compiled epoch time = {steady['eager'] / steady['compiled']:.2f}×. "
        f"Compilation (compiled epoch 1 − its later epochs): {first_compiled - steady['compiled']:.1f} s.",
        "",
    ]
    out = args.out or ROOT / "results" / f"compile_{device.type}"
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
