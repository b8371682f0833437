"""PETRA suite: accuracy and stage memory through the public entry point, throughput against plain
backprop, GPipe and 1F1B, and the paper's Table 3 in kind.

1. **Accuracy** (PETRA's Table 2 in kind): ``revtrain train --stages J`` for J = 2 and 4 (one
   process per stage) and ``--stages 1 --engine simulator`` (one stage is ordinary backprop),
   the same model, data, recipe and epochs; final and best test accuracy, wall time, and what each
   stage keeps (its summary's memory record).
2. **Throughput** (not with ``--quick``): :mod:`revtrain.bench.suites.petra_pipelines`, one thread
   per process, against plain backprop, J independent processes (the machine's ceiling), and
   ``torch.distributed.pipelining``'s GPipe and 1F1B on the same stages.
3. **Memory per buffer setting** (not with ``--quick``): :mod:`revtrain.bench.suites.petra_table3`,
   input buffer and parameter stash on/off, summed over stages.
4. **Rank exit** (``--methods rank-exit`` only): :mod:`revtrain.bench.suites.petra_rank_exit`, how
   often a finished data-parallel rank dies at exit, with and without
   :func:`~revtrain.parallel.distributed.exit_rank`; run alone, its report is
   ``results/petra_<device>_rank_exit``.

Parts 2 to 4 use the parallel package's internals; ``--methods accuracy`` runs part 1 only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from revtrain.bench.report import Column, Report, Table
from revtrain.bench.suites.train import train_run

PARTS = ("accuracy", "throughput", "memory", "rank-exit")
DEFAULT_PARTS = PARTS[:3]
"""What a run without --methods measures (rank-exit is a question of its own: name it)."""


def _parts(options) -> tuple[str, ...]:
    unknown = [p for p in options.methods if p not in PARTS]
    if unknown:
        raise ValueError(f"the petra suite's parts (--methods) are {', '.join(PARTS)}; got {', '.join(unknown)}")
    return tuple(dict.fromkeys(options.methods)) or (("accuracy",) if options.quick else DEFAULT_PARTS)


def report_suffix(options) -> str:
    """``_rank_exit`` when that part runs alone: its report lives beside the suite's."""
    return "_rank_exit" if _parts(options) == ("rank-exit",) else ""


def run(options, device: torch.device, out: Path, log) -> Report:
    parts = _parts(options)
    model = options.models[0] if options.models else "revnet38"
    tables = []
    if "accuracy" in parts:
        tables += accuracy_tables(model, options, log)
    if "throughput" in parts:
        from revtrain.bench.suites.petra_pipelines import default_args, measure_throughput

        args = default_args(model=model, rounds=options.repeats or 2)
        rows = measure_throughput(args, log)
        for r in rows:
            r["per_worker_bytes"] = ", ".join(str(b) for b in r["per_worker_bytes"])
            r["rounds"] = ", ".join(f"{x:.1f}" for x in r["rounds"])
            for key in ("breakdown", "kept_input_bytes", "split"):
                r.pop(key, None)
        tables.append(Table(
            "throughput", "Throughput with fair resources: one thread per process",
            [Column("method", "method"), Column("J", "J", "int"), Column("samples_per_s", "samples/s (best round)", ".1f"),
             Column("rounds", "all rounds"), Column("epoch_samples_per_s", "samples/s over an epoch", ".1f"),
             Column("speedup", "× plain", "ratio"), Column("per_worker_bytes", "per-worker bytes")],
            rows,
            note=(f"{model}, batch {args.batch_size}, {args.image_size}×{args.image_size}. PETRA's samples/s is the "
                  "steady state (every stage busy with one forward and one backward per tick); 'over an epoch' "
                  f"includes the pipeline's warm-up and drain. GPipe and 1F1B cut each batch into {args.microbatches} "
                  "micro-batches and flush every step."), merge_key=()))
    if "memory" in parts:
        from revtrain.bench.suites.petra_table3 import table3

        rows = table3("revnet50", (3, 32, 32), 64, 16, log=log) + table3(model, (1, 8, 8), 64, 9, log=log)
        tables.append(Table(
            "table3", "Memory summed over stages per buffer setting (PETRA's Table 3 in kind)",
            [Column("model", "model"), Column("input", "input"), Column("batch", "batch", "int"), Column("J", "J", "int"),
             Column("input_buffer", "input buffer"), Column("parameter_buffer", "parameter buffer"),
             Column("total_bytes", "total", "bytes"), Column("saving", "saving", "pct"),
             Column("total_without_first_input_bytes", "without stage 0's input", "bytes"),
             Column("saving_without_first_input", "saving", "pct"), Column("kept_bytes", "kept", "bytes")],
            rows,
            note=("Per stage: parameters + the steady-state peak of its forwards and one backward (tensor bytes); "
                  "input buffer off = only non-reversible units keep inputs; parameter buffer off = rebuild with "
                  "the current weights (PETRA)."), merge_key=()))
    if "rank-exit" in parts:
        from revtrain.bench.suites.petra_rank_exit import rank_exit_table

        tables.append(rank_exit_table(options.pick(20, 1), log))
    if parts == ("rank-exit",):
        return Report("petra", "PETRA's ranks: ending a data-parallel rank", {}, tables, intro=_RANK_EXIT_INTRO)
    return Report("petra", "PETRA: accuracy, throughput and memory per stage", {}, tables, intro=_INTRO)


_INTRO = ("Stage-parallel training with delayed gradients (`revtrain train --stages J`). Accuracy runs use the public "
          "command; throughput and the Table 3 memory drive the parallel package directly.")
_RANK_EXIT_INTRO = ("How often a finished data-parallel rank dies at exit (`revtrain bench petra --methods rank-exit`), "
                    "with and without `revtrain.parallel.distributed.exit_rank`.")


def accuracy_tables(model: str, options, log) -> list[Table]:
    epochs = 1 if options.quick else 20
    extra = " --max-steps-per-epoch 3" if options.quick else ""
    runs = {"backprop (J=1)": f"--stages 1 --engine simulator", "PETRA J=2": "--stages 2", "PETRA J=4": "--stages 4"}
    if options.quick:
        runs.pop("PETRA J=4")
    rows, stages = [], []
    with tempfile.TemporaryDirectory(prefix="revtrain-bench-petra-") as tmp:
        for name, flags in runs.items():
            command = f"revtrain train --model {model} --epochs {epochs} {flags} --track-reconstruction{extra}"
            log(f"{name}: {command}")
            done = train_run(command, Path(tmp) / name.replace(" ", "_"))
            epochs_seen = [r for r in done["records"] if "test_acc" in r]
            last = epochs_seen[-1] if epochs_seen else {}
            summary = done["summary"]
            test = summary.get("test") or {}
            rows.append({"run": name, "command": command, "test_accuracy": test.get("acc", last.get("test_acc")),
                         "best_test_accuracy": max((r["test_acc"] for r in epochs_seen), default=None),
                         "train_loss": last.get("train_loss"), "wall_s": done["wall_s"]})
            for s in (summary.get("petra") or {}).get("memory") or []:
                stages.append({"run": name, **{k: s.get(k) for k in ("stage", "first_unit", "last_unit", "reversible",
                                                                     "param_bytes", "optimizer_bytes", "peak_buffer_bytes")}})
    base = rows[0]["test_accuracy"]
    for r in rows:
        r["vs_backprop"] = None if base is None or r["test_accuracy"] is None else r["test_accuracy"] - base
    accuracy = Table(
        "accuracy", "Accuracy against backprop, same recipe (PETRA's Table 2 in kind)",
        [Column("run", "run"), Column("command", "command"), Column("test_accuracy", "final test acc.", ".2%"),
         Column("vs_backprop", "vs backprop", "+.2%"), Column("best_test_accuracy", "best", ".2%"),
         Column("train_loss", "final train loss", ".4f"), Column("wall_s", "wall", "s")],
        rows, note=f"{model} on the digits, {epochs} epoch(s), batch 64, PETRA's recipe (`revtrain train`'s defaults).", merge_key=())
    memory = Table(
        "stages", "What each stage keeps",
        [Column("run", "run"), Column("stage", "stage", "int"), Column("first_unit", "first unit"),
         Column("last_unit", "last unit"), Column("reversible", "reversible"), Column("param_bytes", "parameters", "bytes"),
         Column("optimizer_bytes", "optimizer state", "bytes"), Column("peak_buffer_bytes", "kept inputs at the peak", "bytes")],
        stages, note="From each run's summary: a reversible stage keeps no inputs, a non-reversible one keeps its inputs.", merge_key=())
    return [accuracy, memory]
