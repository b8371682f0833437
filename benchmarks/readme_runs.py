"""Re-measure the README's training figures: run each command as a user would, record what it printed.

Every command runs in a fresh process, one after the other, in a fresh run folder under a
temporary directory; the script writes the command, its last lines (the summary), the figures
parsed from ``summary.json`` and the machine's load average before and after to
``results/readme_runs_<device>.md`` and ``.json``.

    python benchmarks/readme_runs.py                  # every run (~10 min on 2 idle cores)
    python benchmarks/readme_runs.py --only digits    # runs whose name contains "digits"
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LM = "--dataset text --optimizer adamw --lr 3e-3 --grad-clip 1 --warmup-epochs 0.1 --batch-size 32 --epochs 1 --max-steps-per-epoch 600"
RUNS: dict[str, str] = {
    "digits-revnet38": "revtrain train",
    "digits-resnet32": "revtrain train --model resnet32",
    "digits-petra-2-stages": "revtrain train --stages 2",
    "digits-data-parallel-2": "revtrain train --data-parallel 2",
    "text-revformer-small": f"revtrain train --model revformer-small {LM}",
    "text-transformer-small": f"revtrain train --model transformer-small {LM}",
}
"""Name -> the command as the README prints it (``--run-dir`` and ``--quiet`` are added)."""


def _load() -> tuple[float, float, float]:
    return os.getloadavg()


def run_one(name: str, command: str, folder: Path) -> dict:
    run_dir = folder / name
    argv = [*shlex.split(command), "--run-dir", str(run_dir), "--quiet"]
    argv[0:1] = [sys.executable, "-m", "revtrain.cli"]
    before = _load()
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = _load()
    if proc.returncode != 0:
        raise SystemExit(f"{command!r} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    tail = [line for line in proc.stdout.splitlines() if line.strip()][-5:]
    return {
        "name": name, "command": command, "process_wall_s": round(wall, 1),
        "load_before": before, "load_after": after, "output_tail": tail,
        "summary": {k: v for k, v in summary.items() if not isinstance(v, (dict, list))},
    }


def to_markdown(rows: list[dict], device: str, started: str, command: str = "python benchmarks/readme_runs.py") -> str:
    lines = [
        "# README training figures, re-measured",
        "",
        f"- command: `{command}` (each run a fresh process, one after another)",
        f"- device: {device}, torch {_torch_version()}, {os.cpu_count()} CPUs; date {started}",
        "",
        "| run | command | headline | training time | samples/s | step memory (run) | plain backprop | load before → after |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        s = r["summary"]
        head = s.get("headline")
        value = s.get(f"test_{head}")
        headline = f"test {head} {value:.4g}" if isinstance(value, float) else "–"
        mib = lambda b: f"{b / 2**20:.2f} MiB" if b else "–"  # noqa: E731
        # Runs without a training time in their summary (PETRA's launcher) get the process's
        # wall time, marked as such, rather than a zero.
        time_cell = (f"{s['train_time_s']:.1f} s" if s.get("train_time_s") else f"{r['process_wall_s']:.1f} s wall")
        rate = f"{s['samples_per_s']:.0f}" if s.get("samples_per_s") else "–"
        lines.append(
            f"| {r['name']} | `{r['command']}` | {headline} | {time_cell} | "
            f"{rate} | {mib(s.get('step_peak_bytes'))} | {mib(s.get('plain_backprop_peak_bytes'))} | "
            f"{r['load_before'][0]:.2f} → {r['load_after'][0]:.2f} |"
        )
    lines += ["", "What each printed at the end:", ""]
    for r in rows:
        lines += [f"`{r['command']}`", "", "```", *r["output_tail"], "```", ""]
    return "\n".join(lines)


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the runs whose name contains this")
    parser.add_argument("--out", default=str(ROOT / "results" / "readme_runs_cpu"), help="output path without suffix")
    args = parser.parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    rows = []
    with tempfile.TemporaryDirectory(prefix="revtrain-readme-") as tmp:
        for name, command in RUNS.items():
            if args.only in name:
                print(f"{name}: {command}", flush=True)
                rows.append(run_one(name, command, Path(tmp)))
                print("  " + "\n  ".join(rows[-1]["output_tail"]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"started": started, "rows": rows}, indent=2) + "\n")
    command = " ".join(["python benchmarks/readme_runs.py", *(argv if argv is not None else sys.argv[1:])])
    out.with_suffix(".md").write_text(to_markdown(rows, "cpu", started, command) + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
