"""Step time and peak memory of a RevNet-style stack: M-mode, C-mode, plain autograd, checkpoint.

Runs :func:`revtrain.bench.run_stack_benchmark` (batch 32, 64 channels, 32x32, depths 4/8/16/32
by default), prints a markdown table and writes ``results/core_stack_<device>.md`` and ``.json``
with the machine, the load average before and after, and the exact command line.

    python benchmarks/core_stack.py                      # auto device, the spec'd configuration
    python benchmarks/core_stack.py --device cpu --depths 4 8 --repeats 3
    nice -n -5 python benchmarks/core_stack.py --device cpu   # less disturbed by other processes
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from revtrain.bench import (
    METHODS,
    OURS,
    PEERS,
    StackBenchConfig,
    format_table,
    machine_info,
    resolve_device,
    run_stack_benchmark,
)
from revtrain.bench.machine import busy_machine_note
from revtrain.bench.peers import installed_peers
from revtrain.bench.results import write_result
from revtrain.bench.stack import EXTRA_METHODS

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = StackBenchConfig(device="cpu")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:N]")
    parser.add_argument(
        "--depths", type=int, nargs="+", default=list(defaults.depths), help="blocks per stack"
    )
    parser.add_argument("--methods", nargs="+", default=list(OURS), choices=METHODS + EXTRA_METHODS,
                        help="methods to run (peers: " + ", ".join(PEERS) + "; M variants: "
                        + ", ".join(EXTRA_METHODS) + ")")
    parser.add_argument("--with-peers", action="store_true",
                        help="also run every installed peer library (revlib, memcnn, reformer, revtorch)")
    parser.add_argument(
        "--repeats", type=int, default=defaults.repeats, help="timed steps per method and depth"
    )
    parser.add_argument(
        "--warmup", type=int, default=defaults.warmup, help="untimed steps per method and depth"
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch)
    parser.add_argument("--channels", type=int, default=defaults.channels, help="stack width (F, G take half)")
    parser.add_argument("--size", type=int, default=defaults.size, help="feature-map height and width")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results path without suffix (default: results/core_stack_<device>); .md and .json are written",
    )
    return parser.parse_args(argv)


_BUSY_ADVICE = (
    "Other processes shared the cores, so absolute times are inflated and noisy. The round-robin order spreads that noise over all methods, so ratios suffer less, but not nothing: trust a ratio where the wall-time ratio, the CPU-time ratio and the paired ratio (time_ratio_paired in the JSON) agree."
)


def _markdown(config: StackBenchConfig, table: str, meta: dict) -> str:
    info = meta["machine"]
    hw = info.get("gpu") or info["cpu"]
    lines = [
        "# Core stack benchmark",
        "",
        f"RevNet-style stack: F and G = Conv3x3 (no bias) + BatchNorm + ReLU on {config.channels // 2} "
        f"channels; batch {config.batch}, {config.channels} channels, {config.size}x{config.size}, "
        f"{config.dtype}. Step = forward + mean-square loss + backward. Median of {config.repeats} "
        f"timed steps after {config.warmup} warm-up step(s) per method, methods interleaved "
        "round-robin; 'CPU time' = process CPU seconds of a step (all threads), less disturbed "
        "by other processes than wall time. Peak = tensor bytes allocated during one step, "
        "parameter gradients included (separate pass; CPU: "
        "revtrain.memory dispatch tracker, CUDA: max_memory_allocated). 'grad rel. err' = "
        "||g - g_plain|| / ||g_plain|| over all parameter and input gradients concatenated, "
        "checked once per depth before timing.",
        "",
        f"- command: `{meta['command']}`",
        f"- device: {info['device']} ({hw}), torch {info['torch']}, {info['torch_threads']} threads, "
        f"{info['cpu_count']} CPUs",
        f"- date: {info['date']}; wall time {meta['wall_s']:.0f} s",
        f"- load average (1/5/15 min) before: {info['load_average']}, after: "
        f"{meta['machine_after']['load_average']}",
    ]
    if meta.get("note"):
        lines += ["", f"**Note:** {meta['note']}"]
    lines += ["", table, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    config = StackBenchConfig(
        batch=args.batch_size,
        channels=args.channels,
        size=args.size,
        depths=tuple(args.depths),
        methods=tuple(args.methods) + (tuple(p for p in installed_peers() if p not in args.methods)
                                       if args.with_peers else ()),
        repeats=args.repeats,
        warmup=args.warmup,
        device=str(device),
        dtype=args.dtype,
        threads=args.threads,
        measure_memory=not args.no_memory,
    )
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        command = f"nice -n {os.getpriority(os.PRIO_PROCESS, 0)} {command}"
    before = machine_info(device)
    hardware = before.get("gpu") or before["cpu"]
    print(f"{device} ({hardware}), load average {before['load_average']}", flush=True)
    start = time.perf_counter()
    rows = run_stack_benchmark(config, log=lambda line: print(line, flush=True))
    wall = time.perf_counter() - start
    after = machine_info(device)
    table = format_table(rows)
    print(table)

    meta = {
        "command": command,
        "machine": before,
        "machine_after": after,
        "wall_s": wall,
        "note": busy_machine_note(before, after, _BUSY_ADVICE),
    }
    out = args.out if args.out is not None else ROOT / "results" / f"core_stack_{device.type}"
    write_result(out, _markdown(config, table, meta),
                 {**meta, "config": config.to_dict(), "rows": [r.to_dict() for r in rows]})
    if meta["note"]:
        print(meta["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
