"""PETRA's Table 2 in kind: accuracy of PETRA with J = 2 and 4 stages against backprop, same recipe.

Trains the same model on the same data with the same recipe (PETRA's: SGD with Nesterov momentum
0.9, learning rate 0.1 * batch * k / 256, linear warm-up then cosine, weight decay 5e-4 on weights
only) and the same number of epochs:

- backprop: ``revtrain train --stages 1 --engine simulator`` (one stage is ordinary
  backprop: tests/parallel/test_arithmetic.py proves it equal to a plain training loop);
- PETRA: ``--stages 2`` and ``--stages 4`` with one process per stage (``--engine processes``).

Every run tracks, per stage and epoch, how far the rebuilt inputs of its reversible units are
from the forward's (relative L2 error; the parameters moved in between). Writes the runs'
metrics, a table, and ``<out>_curves.png`` (test accuracy and training loss per epoch for every
run, reconstruction error per stage).

    flock /tmp/revtrain-cpu.lock python benchmarks/petra_accuracy.py --epochs 20
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from revtrain.bench import machine_info
from revtrain.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="revnet38")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--warmup-epochs", type=float, default=2.0)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--engine", default="processes", choices=["processes", "simulator"],
                   help="engine of the runs with J > 1 (J = 1 always runs in this process)")
    p.add_argument("--threads", type=int, default=1, help="threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "petra_accuracy_digits")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    before = machine_info("cpu")
    runs: dict[str, Any] = {}
    work = args.out.parent / f"{args.out.name}_runs"
    for j in args.stages:
        run_dir = work / f"J{j}"
        shutil.rmtree(run_dir, ignore_errors=True)
        engine = "simulator" if j == 1 else args.engine
        argv = ["train", "--model", args.model, "--dataset", args.dataset, "--stages", str(j), "--engine", engine,
                "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                "--accumulation", str(args.accumulation), "--warmup-epochs", str(args.warmup_epochs),
                "--threads", str(args.threads), "--seed", str(args.seed), "--track-reconstruction",
                "--run-dir", str(run_dir), "--quiet"]
        if args.image_size is not None:
            argv += ["--image-size", str(args.image_size)]
        start = time.perf_counter()
        if cli_main(argv) != 0:
            raise SystemExit(f"revtrain {' '.join(argv)} failed")
        summary = json.loads((run_dir / "summary.json").read_text())
        seconds = time.perf_counter() - start
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[f"J={j}"] = {"stages": j, "engine": engine, "seconds": seconds, "metrics": metrics,
                          "memory": summary.get("memory")}
        print(f"J={j}: test accuracy {metrics[-1]['test_acc']:.2%} ({seconds:.0f} s)", flush=True)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    result = {"command": command, "machine_before": before, "machine_after": machine_info("cpu"),
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out.parent / f"{args.out.name}_curves.png")
    text = _markdown(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    petra_runs = [r for r in runs.values() if r["stages"] > 1]
    fig, axes = plt.subplots(1, 2 + len(petra_runs), figsize=(5 * (2 + len(petra_runs)), 4))
    for name, run in runs.items():
        epochs = [m["epoch"] for m in run["metrics"]]
        label = "backprop" if run["stages"] == 1 else f"PETRA {name}"
        axes[0].plot(epochs, [100 * m["test_acc"] for m in run["metrics"]], marker="o", ms=3, label=label)
        axes[1].plot(epochs, [m["train_loss"] for m in run["metrics"]], marker="o", ms=3, label=label)
    axes[0].set(title="test accuracy", xlabel="epoch", ylabel="%")
    axes[1].set(title="training loss", xlabel="epoch", yscale="log")
    for ax in axes[:2]:
        ax.legend()
        ax.grid(alpha=0.3)
    for ax, run in zip(axes[2:], petra_runs):
        epochs = [m["epoch"] for m in run["metrics"]]
        for s in range(run["stages"]):
            values = [m["reconstruction_error"][s] for m in run["metrics"]]
            if any(v is not None for v in values):
                ax.plot(epochs, values, marker="o", ms=3, label=f"stage {s}")
        ax.set(title=f"rebuild error, PETRA J={run['stages']}", xlabel="epoch", ylabel="relative L2 error",
               yscale="log")
        ax.legend()
        ax.grid(alpha=0.3)
    a = result["args"]
    fig.suptitle(f"{a['model']} on {a['dataset']}: PETRA vs backprop (batch {a['batch_size']}, k={a['accumulation']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    m0, m1 = result["machine_before"], result["machine_after"]
    lines = [f"# PETRA accuracy: {a['model']} on {a['dataset']}, {a['epochs']} epochs, batch {a['batch_size']}, "
             f"k={a['accumulation']}", "",
             f"Command: `{result['command']}`  ",
             f"Machine: {m0['cpu']}, torch {m0['torch']}; load average before {m0['load_average']}, after "
             f"{m1['load_average']}", "",
             "| run | engine | final test accuracy | best test accuracy | final train loss | "
             "reconstruction error per stage, last epoch | wall time |",
             "|---|---|---:|---:|---:|---|---:|"]
    base = None
    for name, run in result["runs"].items():
        last = run["metrics"][-1]
        best = max(m["test_acc"] for m in run["metrics"])
        base = base if base is not None else last["test_acc"]
        errs = ", ".join("—" if e is None else f"{e:.2e}" for e in last["reconstruction_error"])
        label = "backprop (J=1)" if run["stages"] == 1 else f"PETRA {name}"
        lines.append(f"| {label} | {run['engine']} | {100 * last['test_acc']:.2f}% "
                     f"({100 * (last['test_acc'] - base):+.2f}) | {100 * best:.2f}% | {last['train_loss']:.4f} | "
                     f"{errs} | {run['seconds']:.0f} s |")
    lines += ["", f"Curves: `{Path(a['out']).name}_curves.png`. Stages whose units are all non-reversible "
              "rebuild nothing (—).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
