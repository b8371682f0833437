"""The planner across batch sizes: baseline-M, baseline-C and the plan, predicted and measured.

Runs :func:`revtrain.bench.batch_sweep.run_planner_benchmark` (RevNet-110 on CIFAR-shaped synthetic
batches, batch sizes 8/16/32/64 on CPU by default, one memory budget for all of them; any zoo model
with reversible layers: ``--model revformer_small --input-shape 512`` (a reversible Transformer,
built with the sequence length as its context), ``--model resnext29_iabn`` (In-place ABN layers)),
prints the tables and writes ``results/planner_<model>_<device>.md`` and ``.json`` (with the machine, the
load average before and after and the exact command line) and two figures next to them:
``..._heatmap.png`` (mode per block per batch size, the paper's Fig. 4) and
``..._step_times.png`` (time per iteration and per sample, Fig. 5).

    python benchmarks/planner_sweep.py                          # CUDA when available, else CPU
    nice -n -5 python benchmarks/planner_sweep.py --device cpu
    python benchmarks/planner_sweep.py --device cuda --batch-sizes 64 128 256 512
    python benchmarks/planner_sweep.py --budget 120MiB --batch-sizes 8 16 --repeats 3 --out results/tmp/quick
    python benchmarks/planner_sweep.py --device cpu --model revformer_small --input-shape 512 \
        --batch-sizes 1 2 4 8 16 --model-options positions=rotary
    python benchmarks/planner_sweep.py --device cpu --model resnext29_iabn --batch-sizes 4 8 16 32
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from revtrain.bench import machine_info
from revtrain.bench.batch_sweep import (
    PlannerBenchConfig,
    PlannerBenchResult,
    format_accuracy_table,
    format_planner_table,
    format_refine_table,
    run_planner_benchmark,
    summary_lines,
    to_sweep_result,
)
from revtrain.bench.machine import busy_machine_note
from revtrain.device import resolve_device
from revtrain.memory import format_bytes
from revtrain.options import add_config_options, given_options
from revtrain.planner.envelope import dump_envelope
from revtrain.planner.plots import plot_decision_heatmap, plot_step_times

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = {"cpu": (8, 16, 32, 64), "cuda": (64, 128, 256, 512, 1024)}
RESULTS_KIND = "planner-benchmark"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_options(parser, PlannerBenchConfig, help_suffix={
        "batch_sizes": " Default: 8 16 32 64 on CPU, 64 128 256 512 1024 on CUDA.",
    }, defaults={"batch_sizes": None})
    parser.add_argument(
        "--from-json", type=Path, default=None,
        help="measure nothing: re-render the tables and figures of an earlier results .json (to --out, "
        "default next to it)",
    )
    parser.add_argument(
        "--out", type=Path, default=None,
        help="results path without suffix (default results/planner_<model>_<device>); .md, .json and "
        "_heatmap.png, _step_times.png are written",
    )
    return parser.parse_args(argv)


_BUSY_ADVICE = (
    "Absolute times are inflated and noisy; the settings' steps alternate, so the paired ratios (median of per-round ratios) suffer least."
)


def _markdown(result: PlannerBenchResult, meta: dict, figures: list[Path]) -> str:
    info, cfg = meta["machine"], result.config
    hw = info.get("gpu") or info["cpu"]
    r0 = result.rows[0]
    options = f" ({', '.join(cfg.model_options)})" if cfg.model_options else ""
    kinds = ", ".join(f"{n} {kind}" for kind, n in result.layer_kinds.items()) or "reversible blocks"
    if result.input_kind == "tokens":
        batches = (f"synthetic token batches (sequences of {result.input_shape[0]} random ids below "
                   f"{result.num_classes}, next-id targets; the model built with context {result.input_shape[0]})")
        loss = "language-modelling loss (mean cross-entropy over tokens)"
    else:
        batches = (f"synthetic image batches ({'x'.join(map(str, result.input_shape))}, standard normal, "
                   f"{result.num_classes} classes)")
        loss = "cross-entropy"
    lines = [
        f"# Planner benchmark: {cfg.model}{options} across batch sizes",
        "",
        (f"{cfg.model}{options} ({r0.n_blocks} reversible layers: {kinds}), {batches}, {cfg.dtype}; "
        f"a step is forward + {loss} + backward + SGD(momentum 0.9) step. Per batch size: verify "
        "(once), profile (t_e, m_i, m_o), solve the knapsack (`plan (refine=0)`, the paper's plan), refine "
        f"(`plan`, `plan_for_model(refine={cfg.refine})`), then one measurement in which the four settings' "
        f"steps alternate: {cfg.warmup} warm-up + {cfg.repeats} timed steps each, medians reported, then one "
        "step per setting under the memory tracker (CPU: dispatch-level tensor bytes incl. parameters, "
        "gradients, optimizer state and batch; CUDA: max_memory_allocated). TPI = time per iteration, "
        "TPS = time per sample. Paired = median over rounds of the ratio of the two settings' steps in "
        "the same round. baseline-C is measured even where its peak exceeds the budget (marked ✗): "
        "the plan may not use it there."),
        "",
        f"- command: `{meta['command']}`",
        (f"- device: {info['device']} ({hw}), torch {info['torch']}, {info['torch_threads']} thread(s) "
        f"during the run, {info['cpu_count']} CPUs"),
        f"- date: {info['date']}; wall time {meta['wall_s']:.0f} s",
        (f"- load average (1/5/15 min) before: {info['load_average']}, after: "
        f"{meta['machine_after']['load_average']}"),
        f"- budget: {result.budget_source}",
        f"- timing environment: {info.get('env') or 'none set'}",
    ]
    if meta.get("note"):
        lines += ["", f"**Note:** {meta['note']}"]
    lines += [
        "", "## Time per iteration and per sample (paper Fig. 5, Table 2)", "",
        format_planner_table(result.rows), "",
        "## Summary", "", *summary_lines(result), "",
        "## Predicted vs measured", "",
        ("Predicted before the measurement, from each batch size's own profile. Step time: baseline-M's "
        "profiled step − t_e_scale × Σt_e over C-mode blocks (t_e_scale = the profile's measured "
        "(baseline-M − baseline-C) ÷ Σt_e, per batch size in the JSON); 'pred. from this run's M' starts "
        "from this measurement's baseline-M instead (the t_e model's error alone). Peak: what the planner "
        "reports (`plan.predicted_peak_bytes`: for a refined plan the peak measured while refining, "
        "for a solved plan the additive model or the measured baseline-C peak if that fits); "
        "additive model: m_o + Σm_i over C-mode blocks. Error = (predicted − measured) / measured."),
        "", format_accuracy_table(result.rows), "",
        "## The paper's knapsack (refine=0) vs the refined plan, and the planner's own cost", "",
        format_refine_table(result.rows), "",
        "## Figures", "",
        *[f"![{p.stem}]({p.name})" for p in figures], "",
    ]
    return "\n".join(lines)


def _write(result: PlannerBenchResult, meta: dict, out: Path) -> list[Path]:
    """Write ``out``.md, .json and the two figures; returns the figures' paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep = to_sweep_result(result)
    figures = [
        plot_decision_heatmap(sweep, out.with_name(out.name + "_heatmap.png")),
        plot_step_times(sweep, out.with_name(out.name + "_step_times.png")),
    ]
    out.with_suffix(".md").write_text(_markdown(result, meta, figures))
    payload = {**meta, **result.to_dict(), "sweep": json.loads(sweep.to_json())}
    dump_envelope(RESULTS_KIND, payload, out.with_suffix(".json"))
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        payload = data["payload"] if data.get("kind") == f"revtrain.{RESULTS_KIND}" else data  # or unwrapped, as before
        meta = {k: payload[k] for k in ("command", "machine", "machine_after", "wall_s", "note")}
        result = PlannerBenchResult.from_dict(payload)
        out = args.out if args.out is not None else args.from_json.with_suffix("")
        figures = _write(result, meta, out)
        print(f"re-rendered {args.from_json} to {out.with_suffix('.md')}, .json and {', '.join(p.name for p in figures)}")
        return 0
    options = given_options(args, PlannerBenchConfig)
    device = resolve_device(options.get("device", PlannerBenchConfig.device))
    if options.get("batch_sizes") is None:
        options["batch_sizes"] = DEFAULT_SIZES["cuda" if device.type == "cuda" else "cpu"]
    config = PlannerBenchConfig(**{**options, "device": str(device)})
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        command = f"nice -n {os.getpriority(os.PRIO_PROCESS, 0)} {command}"
    before = machine_info(device)
    before["torch_threads"] = config.threads
    print(f"{device} ({before.get('gpu') or before['cpu']}), load average {before['load_average']}", flush=True)
    start = time.perf_counter()
    result = run_planner_benchmark(config, log=lambda line: print(line, flush=True))
    wall = time.perf_counter() - start
    after = machine_info(device)
    meta = {
        "command": command, "machine": before, "machine_after": after, "wall_s": wall,
        "note": busy_machine_note(before, after, _BUSY_ADVICE),
    }
    out = args.out if args.out is not None else ROOT / "results" / f"planner_{config.model}_{device.type}"
    figures = _write(result, meta, out)
    print(format_planner_table(result.rows))
    print()
    print("\n".join(summary_lines(result)))
    if meta["note"]:
        print(meta["note"])
    print(f"budget {format_bytes(result.budget_bytes)}; wrote {out.with_suffix('.md')}, .json and "
          f"{', '.join(p.name for p in figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
