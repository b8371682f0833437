"""The planner across batch sizes: baseline-M, baseline-C and the plan, predicted and measured.

Runs :func:`revtrain.bench.planner.run_planner_benchmark` (RevNet-110 on CIFAR-shaped synthetic
batches, batch sizes 8/16/32/64 on CPU by default, one memory budget for all of them), prints the
tables and writes ``results/planner_<model>_<device>.md`` and ``.json`` (with the machine, the
load average before and after and the exact command line) and two figures next to them:
``..._heatmap.png`` (mode per block per batch size, the paper's Fig. 4) and
``..._step_times.png`` (time per iteration and per sample, Fig. 5).

    python benchmarks/planner_sweep.py                          # CUDA when available, else CPU
    nice -n -5 python benchmarks/planner_sweep.py --device cpu
    python benchmarks/planner_sweep.py --device cuda --batch-sizes 64 128 256 512
    python benchmarks/planner_sweep.py --budget 120MiB --batch-sizes 8 16 --repeats 3 --out results/tmp/quick
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
from revtrain.bench.machine import busy_machine_note
from revtrain.bench.planner import (
    PlannerBenchConfig,
    PlannerBenchResult,
    format_accuracy_table,
    format_planner_table,
    format_refine_table,
    run_planner_benchmark,
    to_sweep_result,
)
from revtrain.bench.stack import resolve_device
from revtrain.memory import format_bytes
from revtrain.planner.plots import plot_decision_heatmap, plot_step_times

ROOT = Path(__file__).resolve().parent.parent
# Above this load per core, other processes compete for the cores and timings are disturbed.
DEFAULT_SIZES = {"cpu": (8, 16, 32, 64), "cuda": (64, 128, 256, 512, 1024)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = PlannerBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=d.model, help="zoo model (default revnet110)")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None,
        help="batch sizes (default: 8 16 32 64 on CPU, 64 128 256 512 1024 on CUDA)",
    )
    parser.add_argument(
        "--budget", default=None,
        help="peak-memory budget for every batch size: bytes, 120MiB, 50%% (of the device's memory). "
        "Default: automatic, --budget-margin x max(baseline-C peak at the smallest batch size, "
        "baseline-M peak at the largest), so that baseline-C fits only at the small end and the "
        "plan must mix modes in between",
    )
    parser.add_argument("--budget-margin", type=float, default=d.budget_margin, help="see --budget (default 1.2)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:N]")
    parser.add_argument("--dtype", default=d.dtype, choices=("float32", "float64", "bfloat16"))
    parser.add_argument(
        "--input-shape", type=int, nargs="+", default=None, help="one sample's shape, e.g. 3 32 32 (default: the model's)"
    )
    parser.add_argument("--repeats", type=int, default=d.repeats, help="timed steps per setting (default 5)")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per setting (default 2)")
    parser.add_argument(
        "--profile-repeats", type=int, default=d.profile_repeats, help="repetitions per profiling measurement"
    )
    parser.add_argument("--refine", type=int, default=d.refine, help="plan_for_model(refine=...) (default 4)")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU intra-op threads (default 1: with 2 threads on a shared 2-core machine the threads "
        "spin-wait for each other and timings become unusable under any load)",
    )
    parser.add_argument("--seed", type=int, default=d.seed)
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


def _summary(result: PlannerBenchResult) -> list[str]:
    """Findings computed from the rows, so the text can never disagree with the table."""
    rows = result.rows
    lines = []
    tight = [r for r in rows if not r.settings["baseline-C"].fits]
    roomy = [r for r in rows if r.settings["baseline-C"].fits]
    if tight:
        sp = ", ".join(f"{r.speedup_paired[0]:.2f}× (b={r.batch_size})" for r in tight)
        lines.append(f"- Where baseline-C does not fit the budget, the plan's speed-up over baseline-M (paired): {sp}.")
    if roomy:
        eq = ", ".join(
            f"{r.plan_vs_c_paired[0]:.3f} (b={r.batch_size}, plan {r.settings['plan'].c_blocks}/{r.n_blocks} C)"
            for r in roomy
        )
        lines.append(f"- Where baseline-C fits, plan ÷ baseline-C step time (paired): {eq}.")
    worst = min(rows, key=lambda r: r.speedup_paired[0])
    lines.append(
        f"- Lowest paired speed-up over baseline-M: {worst.speedup_paired[0]:.3f} at batch "
        f"{worst.batch_size} (IQR of the per-round ratio {worst.speedup_paired[1]:.3f})."
    )
    over = [r.batch_size for r in rows if not r.settings["plan"].fits]
    lines.append(
        "- Every plan's measured peak kept within the budget." if not over
        else f"- The plan's measured peak EXCEEDED the budget at batch sizes {over}."
    )
    step_err = [r.settings["plan"].step_time_error for r in rows]
    step_err0 = [r.settings["plan"].step_time_from_run_M_s / r.settings["plan"].step_time_s - 1 for r in rows]
    lines.append(
        f"- Plan step time, predicted − measured: {_span(step_err)} of measured (from the profile's "
        f"baseline-M); {_span(step_err0)} when the same run's baseline-M is the starting point."
    )
    peak0 = [r.settings["plan (refine=0)"].additive_peak_error for r in rows if r.settings["plan (refine=0)"].c_blocks]
    peak_c = [r.settings["baseline-C"].additive_peak_error for r in rows]
    peak_p = [r.settings["plan"].peak_error for r in rows]
    if peak0:
        lines.append(f"- Peak of the knapsack's plan (refine=0), additive model m_o + Σm_i vs measured: {_span(peak0)}.")
    lines.append(f"- Baseline-C peak, additive model vs measured: {_span(peak_c)} (the model adds every m_i at baseline-M's peak moment).")
    lines.append(
        f"- Peak of the refined plan, as the plan predicts it vs measured: {_span(peak_p)} (where refinement "
        "changed the plan, its prediction is the peak measured while refining)."
    )
    te = [r.sum_t_e_s / (r.settings["baseline-M"].step_time_s - r.settings["baseline-C"].step_time_s) for r in rows]
    lines.append(f"- Σt_e ÷ measured (baseline-M − baseline-C): {', '.join(f'{x:.2f}' for x in te)} across batch sizes.")
    return lines


def _span(values: list[float]) -> str:
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo:+.1%}" if abs(hi - lo) < 5e-4 else f"{lo:+.1%} to {hi:+.1%}"


def _markdown(result: PlannerBenchResult, meta: dict, figures: list[Path]) -> str:
    info, cfg = meta["machine"], result.config
    hw = info.get("gpu") or info["cpu"]
    r0 = result.rows[0]
    lines = [
        f"# Planner benchmark: {cfg.model} across batch sizes",
        "",
        (f"{cfg.model} ({r0.n_blocks} reversible blocks), synthetic CIFAR-shaped batches "
        f"({'x'.join(map(str, result.input_shape))}, {result.num_classes} classes), {cfg.dtype}; "
        "a step is forward + cross-entropy + backward + SGD(momentum 0.9) step. Per batch size: verify "
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
        "## Summary", "", *_summary(result), "",
        "## Predicted vs measured", "",
        ("Predicted before the measurement, from each batch size's own profile. Step time: baseline-M's "
        "profiled step − Σt_e over C-mode blocks; 'pred. from this run's M' starts from this "
        "measurement's baseline-M instead (the t_e model's error alone). Peak: what the planner "
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
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        payload = json.loads(args.from_json.read_text())
        meta = {k: payload[k] for k in ("command", "machine", "machine_after", "wall_s", "note")}
        result = PlannerBenchResult.from_dict(payload)
        out = args.out if args.out is not None else args.from_json.with_suffix("")
        figures = _write(result, meta, out)
        print(f"re-rendered {args.from_json} to {out.with_suffix('.md')}, .json and {', '.join(p.name for p in figures)}")
        return 0
    device = resolve_device(args.device)
    sizes = tuple(args.batch_sizes or DEFAULT_SIZES["cuda" if device.type == "cuda" else "cpu"])
    config = PlannerBenchConfig(
        model=args.model, batch_sizes=sizes, budget=args.budget, budget_margin=args.budget_margin,
        device=str(device), dtype=args.dtype, input_shape=tuple(args.input_shape) if args.input_shape else None,
        repeats=args.repeats, warmup=args.warmup,
        profile_repeats=args.profile_repeats, refine=args.refine,
        threads=args.threads if args.threads is not None else 1, seed=args.seed,
    )
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
    out = args.out if args.out is not None else ROOT / "results" / f"planner_{args.model}_{device.type}"
    figures = _write(result, meta, out)
    print(format_planner_table(result.rows))
    print()
    print("\n".join(_summary(result)))
    if meta["note"]:
        print(meta["note"])
    print(f"budget {format_bytes(result.budget_bytes)}; wrote {out.with_suffix('.md')}, .json and "
          f"{', '.join(p.name for p in figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
