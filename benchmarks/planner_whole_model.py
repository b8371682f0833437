"""The planner for the whole model: fastest step under budgets down to what recomputation allows.

For each model (RevNet-38, RevNet-110 by default; 32x32 inputs, batch 64, SGD with momentum, one
CPU thread), one profile with every option (M/C per reversible block; keep or recompute per
plain layer) serves a ladder of budgets, from plain backprop's step memory down to the smallest
step the new options reach (every block in M-mode, every plain layer recomputed, measured). At
each budget it plans with every option (the new planner) and with Jiang et al.'s M/C choice only
(a), and measures, in one run whose settings' timed steps alternate:

* the new plans and the M/C-only plans;
* (b) ``torch.utils.checkpoint`` on every plain (non-reversible) layer with every block in M-mode;
* (c) plain backprop (every block in C-mode, nothing recomputed).

Each plan's peak is measured (its step memory, the budget's quantity), and the new plan's step is
compared with the M/C-only plan's by paired ratios of the same rounds, with a 95% interval
(:func:`revtrain.timing.median_interval`). Writes ``results/planner_<device>_whole_model.md`` and
``.json``::

    nice python benchmarks/planner_whole_model.py
    python benchmarks/planner_whole_model.py --models revnet38 --batch-size 16 --rounds 3 --out results/tmp/pw
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from revtrain.bench import machine_info
from revtrain.bench.machine import busy_machine_note, machine_line
from revtrain.bench.results import write_result
from revtrain.memory import format_bytes
from revtrain.models import create_model, example_batch
from revtrain.planner import (
    BudgetTooSmallError,
    TimingRule,
    measure_steps,
    plain_layers,
    prepare,
    profile_setup,
    run_pipeline,
)
from revtrain.timing import median_interval

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["revnet38", "revnet110"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--input-size", type=int, default=32, help="height and width of the 3-channel inputs")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of the final comparison")
    p.add_argument("--t-e-max-pairs", type=int, default=6, help="M/C pairs per block at most while profiling")
    p.add_argument("--refine", type=int, default=2, help="richer plans measured per budget (revtrain plan --refine)")
    p.add_argument("--steps-below", type=int, default=4,
                   help="budgets between all-M's step memory and the smallest, evenly spaced")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def run_model(name: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    size = (3, args.input_size, args.input_size)
    torch.manual_seed(0)
    model = create_model(name)
    batch = example_batch(name, args.batch_size, input_size=size)
    rule = TimingRule(warmup_pairs=1, min_pairs=3, max_pairs=args.t_e_max_pairs)
    out: dict[str, Any] = {"model": name, "batch_size": args.batch_size, "input_shape": list(size)}
    with prepare(model, batch, device=args.device, repeats=1, max_repeats=2, warmup=1, model_name=name) as setup:
        start = time.perf_counter()
        log(f"{name}: profiling every layer's options ...")
        profile = profile_setup(setup, timing=rule, run_baseline_c=True)
        out["profile_s"] = time.perf_counter() - start
        layers = [n for n, _ in plain_layers(model)]
        smallest = {**{b.name: "M" for b in profile.blocks}, **dict.fromkeys(layers, "recompute")}
        refs = measure_steps(setup, {"plain": "C", "all-M": "M", "smallest": smallest}, repeats=0)
        plain, all_m, low = (refs[k].peak_bytes for k in ("plain", "all-M", "smallest"))
        out["reference_peaks"] = {"plain": plain, "all-M": all_m, "smallest": low}
        ladder = [plain, (plain + all_m) // 2, all_m]
        ladder += [all_m - (all_m - low) * k // args.steps_below for k in range(1, args.steps_below + 1)]
        plans: dict[int, dict[str, Any]] = {}
        for budget in ladder:
            row: dict[str, Any] = {"budget": budget}
            for key, choices in (("new", "all"), ("mc", "mc")):
                try:
                    result = run_pipeline(setup, budget, verify=False, profile=profile, refine=args.refine,
                                          choices=choices)
                except BudgetTooSmallError as err:
                    row[key] = {"feasible": False, "why": str(err).split(";")[0]}
                    continue
                plan = result.plan
                row[key] = {"feasible": True, "setting": plan.setting(), "predicted_s": plan.predicted_step_time_s,
                            "peak": plan.predicted_peak_bytes, "c_blocks": len(plan.c_mode_blocks),
                            "recomputed": plan.recomputed_layers}
            plans[budget] = row
            log(f"  budget {format_bytes(budget)}: new "
                + (f"{row['new']['c_blocks']} C + {row['new']['recomputed']}" if row["new"]["feasible"] else "none")
                + ", M/C only " + (f"{row['mc']['c_blocks']} C" if row["mc"]["feasible"] else "none"))
        settings: dict[str, Any] = {"(c) plain": "C", "(b) checkpoint + M": smallest}
        names: dict[tuple, str] = {}
        for budget, row in plans.items():
            for key in ("new", "mc"):
                if row[key]["feasible"]:
                    ident = tuple(sorted(row[key]["setting"].items()))
                    names.setdefault(ident, f"{key}@{budget}")
                    settings.setdefault(names[ident], row[key]["setting"])
                    row[key]["name"] = names[ident]
        log(f"{name}: measuring {len(settings)} settings, their steps alternating, {args.rounds} rounds ...")
        measured = measure_steps(setup, settings, repeats=args.rounds)
        out["total_s"] = time.perf_counter() - start
    out["measured"] = {k: {"step_s": v.step_time_s, "times_s": list(v.times_s), "peak": v.peak_bytes}
                       for k, v in measured.items()}
    for row in plans.values():
        for key in ("new", "mc"):
            if row[key]["feasible"]:
                row[key].pop("setting")
        if row["new"]["feasible"] and row["mc"]["feasible"]:
            a, b = measured[row["new"]["name"]].times_s, measured[row["mc"]["name"]].times_s
            iv = median_interval([x / y for x, y in zip(a, b)])
            row["new_over_mc"] = [iv.median, iv.low, iv.high]
    out["plans"] = list(plans.values())
    out["warnings"] = profile.warnings
    out["layers"] = [{"name": x.name, "recompute_s": x.recompute_s, "frees": x.recompute_saves_bytes}
                     for x in profile.layers]
    return out


def format_model(r: dict[str, Any]) -> str:
    m, ref = r["measured"], r["reference_peaks"]

    def cell(name: str) -> str:
        x = m[name]
        iv = median_interval(x["times_s"]) if x["times_s"] else None
        span = f" [{iv.low:.3f}, {iv.high:.3f}]" if iv and len(x["times_s"]) > 1 else ""
        return f"{x['step_s']:.3f}{span} s, {format_bytes(x['peak'])}"

    lines = [
        f"## {r['model']}, batch {r['batch_size']}, {'x'.join(map(str, r['input_shape']))}",
        "",
        f"Step memory: plain backprop {format_bytes(ref['plain'])}, all-M {format_bytes(ref['all-M'])}, smallest "
        f"(all-M, every plain layer recomputed) {format_bytes(ref['smallest'])} "
        f"({1 - ref['smallest'] / ref['all-M']:.1%} below all-M). Profiling took {r['profile_s']:.0f} s, the "
        f"whole model {r['total_s']:.0f} s.",
        "",
        f"(b) checkpoint on every plain layer + all blocks M: {cell('(b) checkpoint + M')}; "
        f"(c) plain backprop: {cell('(c) plain')}.",
        "",
        "| budget | vs all-M | new plan: C blocks, recomputed | new: step [95%], peak | (a) M/C only: C blocks | "
        "(a): step [95%], peak | new / (a), paired [95%] | (b) fits | (c) fits |",
        "|---:|---:|---|---|---:|---|---|---|---|",
    ]
    for row in r["plans"]:
        b = row["budget"]
        new, mc = row["new"], row["mc"]
        n_plan = f"{new['c_blocks']}, {', '.join(new['recomputed']) or '-'}" if new["feasible"] else "no plan"
        n_step = cell(new["name"]) if new["feasible"] else "-"
        a_plan = f"{mc['c_blocks']}" if mc["feasible"] else "infeasible"
        a_step = cell(mc["name"]) if mc["feasible"] else "-"
        ratio = "-"
        if "new_over_mc" in row:
            med, lo, hi = row["new_over_mc"]
            ratio = f"{med:.3f} [{lo:.3f}, {hi:.3f}]"
        fits_b = "yes" if m["(b) checkpoint + M"]["peak"] <= b else "no"
        fits_c = "yes" if m["(c) plain"]["peak"] <= b else "no"
        lines.append(f"| {format_bytes(b)} | {b / ref['all-M'] - 1:+.1%} | {n_plan} | {n_step} | {a_plan} | {a_step} | "
                     f"{ratio} | {fits_b} | {fits_c} |")
    lines += ["", "Plain layers (recompute cost, bytes freed): " + "; ".join(
        f"{x['name']} +{x['recompute_s'] * 1e3:.1f} ms, {format_bytes(x['frees'])}" for x in r["layers"])]
    for w in r["warnings"]:
        lines.append(f"\nProfile warning: {w}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = args.device.split(":")[0]
    out = args.out or ROOT / "results" / f"planner_{device}_whole_model"
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        command = f"nice -n {os.getpriority(os.PRIO_PROCESS, 0)} {command}"
    before = machine_info(args.device)
    start = time.perf_counter()
    results = []
    for name in args.models:
        results.append(run_model(name, args, lambda line: print(line, flush=True)))
    wall = time.perf_counter() - start
    after = machine_info(args.device)
    note = busy_machine_note(before, after, "Step times are inflated and noisy; the settings' steps alternate, so "
                             "the paired ratios suffer least.")
    text = "\n".join([
        "# The planner for the whole model: recompute plain layers, M/C for reversible ones",
        "",
        f"command: `{command}`",
        "",
        machine_line(before, after, wall),
        *([note] if note else []),
        "",
        "Budgets bound the step memory (peak tensor bytes of one training step: parameters, gradients, "
        "optimizer state, batch, activations, caches kept between steps). 'new' plans with every option, "
        "(a) with Jiang et al.'s M/C choice only; peaks are measured. Step times are medians of rounds whose "
        "settings alternate, with 95% intervals; 'new / (a)' is the median of per-round ratios.",
        "",
        *(format_model(r) for r in results),
    ])
    write_result(out, text, {"command": command, "machine": before, "machine_after": after, "wall_s": wall,
                             "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
