"""Compile suite: what ``revtrain train --compile`` gains, from two runs in fresh processes with the
same seed, eager (``--no-compile``) then compiled (default: RevNet-38 on the digits, 4 epochs,
M-mode). The steady-state gain compares the epochs after the first; the compilation time is the
compiled run's first epoch minus its steady epoch time (the first steps pay the compilation).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from revtrain.bench.report import Column, Report, Table
from revtrain.bench.suites.train import train_run


def _epochs(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "epoch" or "epoch_train_time_s" in r]


def run(options, device: torch.device, out: Path, log) -> Report:
    model = options.models[0] if options.models else "revnet38"
    epochs = 2 if options.quick else 4
    base = f"revtrain train --model {model} --epochs {epochs} --mode M"
    if options.quick:
        base += " --max-steps-per-epoch 3"
    rows, steady = [], {}
    with tempfile.TemporaryDirectory(prefix="revtrain-bench-compile-") as tmp:
        for label, flag in (("eager", "--no-compile"), ("compiled", "--compile")):
            log(f"{label}: {base} {flag}")
            done = train_run(f"{base} {flag}", Path(tmp) / label, device)
            per_epoch = _epochs(done["records"])
            later = per_epoch[1:] or per_epoch
            steady[label] = statistics.median(e["epoch_train_time_s"] for e in later)
            last = per_epoch[-1]
            rows.append({
                "run": label, "process_wall_s": done["wall_s"], "epoch1_s": per_epoch[0]["epoch_train_time_s"],
                "later_epoch_s": steady[label], "samples_per_s": statistics.median(e["samples_per_s"] for e in later),
                "test_accuracy": last.get("test_accuracy", last.get("test_acc")),
            })
    gain = steady["eager"] / steady["compiled"]
    compile_s = rows[1]["epoch1_s"] - steady["compiled"]
    for r in rows:
        r["gain"] = gain if r["run"] == "compiled" else 1.0
        r["compile_s"] = compile_s if r["run"] == "compiled" else 0.0
    table = Table(
        "runs", "Eager against compiled",
        [Column("run", "run"), Column("process_wall_s", "process wall", "s"), Column("epoch1_s", "epoch 1", "s"),
         Column("later_epoch_s", "later epochs (median)", "s"), Column("samples_per_s", "samples/s (later epochs)", ".0f"),
         Column("test_accuracy", "test acc. (last)", ".4f"), Column("gain", "gain (eager / this)", "ratio"),
         Column("compile_s", "compilation", "s")],
        rows, note=f"`{base}`, eager (`--no-compile`) then `--compile`, fresh processes, same seed.")
    return Report("compile", "torch.compile on the training loop", {}, [table], intro=__doc__.strip())
