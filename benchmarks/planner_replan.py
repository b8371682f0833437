"""Re-plan one case several times: do the plans run equally fast, and does the prediction hold?

Runs ``revtrain plan`` ``--replans`` times (3) on RevNet-110, batch 32, a 131 MiB budget (a mixed
plan), each in a fresh process with 1 CPU thread, then measures every plan and baseline-M in one
run whose steps alternate (:mod:`revtrain.bench.replan`). Writes
``results/planner_replan_<model>_<device>.md`` and ``.json`` with the machine, the load average
before and after and the exact command line. Run it on an idle machine::

    flock /tmp/revtrain-cpu.lock nice -n -5 python benchmarks/planner_replan.py
    python benchmarks/planner_replan.py --batch-size 16 --budget 120MiB --out results/tmp/replan16
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from revtrain.bench import machine_info
from revtrain.bench.machine import busy_machine_note
from revtrain.bench.replan import ReplanBenchConfig, format_replan_table, goal_lines, run_replan_benchmark
from revtrain.memory import format_bytes
from revtrain.options import add_config_options, given_options
from revtrain.planner.envelope import dump_envelope

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_options(parser, ReplanBenchConfig)
    parser.add_argument("--out", type=Path, default=None,
                        help="results path without suffix (default results/planner_replan_<model>_<device>); "
                        ".md and .json are written, the plans and profiles into a folder of that name")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = ReplanBenchConfig(**given_options(args, ReplanBenchConfig))
    device = config.device.split(":")[0]
    out = args.out if args.out is not None else ROOT / "results" / f"planner_replan_{config.model}_{device}"
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        command = f"nice -n {os.getpriority(os.PRIO_PROCESS, 0)} {command}"
    before = machine_info(config.device)
    before["torch_threads"] = config.threads
    print(f"{config.device} ({before.get('gpu') or before['cpu']}), load average {before['load_average']}", flush=True)
    start = time.perf_counter()
    result = run_replan_benchmark(config, out, log=lambda line: print(line, flush=True))
    wall = time.perf_counter() - start
    after = machine_info(config.device)
    note = busy_machine_note(before, after, "Step times are inflated and noisy; the comparison's steps alternate, "
                             "so the spread between plans suffers least.")
    meta = {"command": command, "machine": before, "machine_after": after, "wall_s": wall, "note": note}
    table, goals = format_replan_table(result), goal_lines(result)
    c = config
    lines = [
        f"# Re-planning {c.model}, batch {c.batch_size}, budget {c.budget}: {c.replans} runs of `revtrain plan`",
        "",
        (f"Each run is `revtrain plan` in a fresh process ({c.threads} thread(s), `--repeats {c.plan_repeats}`, "
         f"t_e timed in M/C pairs until its standard error is {c.t_e_precision:.0%} of it, at most "
         f"{c.t_e_max_pairs} pairs). Its prediction is printed before it measures the plan's real step at the "
         "end of planning. Then every plan and baseline-M run in one measurement whose steps alternate "
         f"({c.warmup} warm-up + {c.repeats} timed steps each, medians); 'paired' is the median over rounds of "
         "the ratio to re-plan 1's step in the same round. The t_e noise of a prediction is "
         "sqrt(Σ over C-mode blocks of (0.929 · IQR / √pairs)²) from its profile."),
        "",
        f"- command: `{command}`",
        (f"- device: {before['device']} ({before.get('gpu') or before['cpu']}), torch {before['torch']}, "
         f"{before['cpu_count']} CPUs"),
        f"- date: {before['date']}; wall time {wall:.0f} s (comparison {result.comparison_s:.0f} s)",
        f"- load average (1/5/15 min) before: {before['load_average']}, after: {after['load_average']}",
        f"- budget: {format_bytes(result.budget_bytes)}",
        f"- timing environment: {before.get('env') or 'none set'}",
    ]
    if note:
        lines += ["", f"**Note:** {note}"]
    lines += ["", "## Plans", "", table, "", "## Goals (issue 7)", "", *goals, ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines))
    dump_envelope("planner-replan", {**meta, **result.to_dict()}, out.with_suffix(".json"))
    print(table)
    print("\n".join(goals))
    if note:
        print(note)
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
