"""Where one training step of each method spends its time: torch.profiler over a few steps of the
core stack (the stack benchmark's models, ``revtrain.bench.stack``), per method.

For each method: the ops and device kernels launched per step, the host-device synchronisations
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``aten::_local_scalar_dense``, copies to the
host), and the ops with the most self host time per step. On a GPU, where small kernels finish
before Python launches the next, the launch count and the syncs decide a step's time. Writes
``results/step_profile_<shape>_<device>.md`` and ``.json``.

    python benchmarks/step_profile.py --shape 32x64x32x8 --device cuda
    python benchmarks/step_profile.py --shape 8x16x8x16 --methods plain M M-nocheck revlib
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from revtrain.bench import StackBenchConfig, machine_info
from revtrain.bench.results import write_result
from revtrain.bench.stack import _clear_grads, _step, parse_stack_shape, stack_setup
from revtrain.device import resolve_device, synchronize

ROOT = Path(__file__).resolve().parent.parent

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
"""Profiler events that make the host wait for the device."""
COPY_TO_HOST = "Memcpy DtoH"
"""A device kernel-list entry for a copy to host memory (it syncs too)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="32x64x32x8", help="BATCHxCHANNELSxSIZExDEPTH")
    parser.add_argument("--methods", nargs="+", default=["plain", "C", "M", "M-nocheck", "revlib"])
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per method")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="ops listed per method")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... or auto")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def profile_method(model: torch.nn.Module, x: torch.Tensor, params: list, device: torch.device,
                   steps: int, warmup: int) -> dict:
    """Per-step counts and host times of one method's steps, from one profiler session."""
    for _ in range(warmup):
        _clear_grads(params, x)
        _step(model, x)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            _clear_grads(params, x)
            _step(model, x)
        synchronize(device)
    wall = (time.perf_counter() - start) / steps
    host_ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [count, self host us]
    kernels = 0
    syncs: dict[str, int] = defaultdict(int)
    for event in prof.events():
        device_type = str(getattr(event, "device_type", "")).rsplit(".", 1)[-1]
        if device_type == "CUDA":
            kernels += 1
            if COPY_TO_HOST in event.name:
                syncs[COPY_TO_HOST] += 1
            continue
        entry = host_ops[event.name]
        entry[0] += 1
        entry[1] += event.self_cpu_time_total
        if event.name in SYNC_EVENTS:
            syncs[event.name] += 1
    aten = sum(c for name, (c, _) in host_ops.items() if name.startswith("aten::"))
    top = sorted(host_ops.items(), key=lambda kv: -kv[1][1])
    return {
        "wall_ms_per_step_profiled": wall * 1e3,
        "aten_ops_per_step": aten / steps,
        "device_kernels_per_step": kernels / steps,
        "syncs_per_step": {k: v / steps for k, v in sorted(syncs.items())},
        "top_self_host": [
            {"op": name, "calls_per_step": c / steps, "self_host_us_per_step": t / steps} for name, (c, t) in top
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        batch, channels, size, depth = parse_stack_shape(args.shape)
    except ValueError as e:
        raise SystemExit(f"--shape: {e}") from None
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"--device: {e}") from None
    methods = list(dict.fromkeys(["plain", *args.methods]))
    config = StackBenchConfig(batch=batch, channels=channels, size=size, depths=(depth,),
                              methods=tuple(methods), repeats=args.steps, warmup=args.warmup, device=str(device))
    info = machine_info(device)
    models, x, params = stack_setup(depth, config, device)
    with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own start-up, not timed
        _step(models["plain"], x)
    results = {m: profile_method(models[m], x, params, device, args.steps, args.warmup) for m in methods}

    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(
        ["python", "benchmarks/step_profile.py", *argv])
    where = info.get("gpu", info["cpu"])
    lines = [
        f"# Step profile at batch {batch}, {channels} channels, {size}×{size}, depth {depth}",
        "",
        f"torch.profiler over {args.steps} steps per method after {args.warmup} warm-up steps; counts and "
        "host times per step. 'syncs': events that make the host wait for the device. The profiler "
        "itself slows each op, so the step times here are for comparison within this table only.",
        "",
        f"- command: `{command}`",
        f"- device: {info['device']} ({where}), torch {info['torch']}, {info['torch_threads']} threads",
        f"- date: {info['date']}; load average {info['load_average']}",
        "",
        "| method | step ms (profiled) | aten ops | device kernels | syncs |",
        "|:---|---:|---:|---:|:---|",
    ]
    for m, r in results.items():
        syncs = ", ".join(f"{k} {v:g}" for k, v in r["syncs_per_step"].items()) or "none"
        lines.append(f"| {m} | {r['wall_ms_per_step_profiled']:.2f} | {r['aten_ops_per_step']:.0f} | "
                     f"{r['device_kernels_per_step']:.0f} | {syncs} |")
    for m, r in results.items():
        lines += ["", f"## {m}: ops with the most self host time per step", "",
                  "| op | calls | self host µs |", "|:---|---:|---:|"]
        lines += [f"| `{t['op']}` | {t['calls_per_step']:g} | {t['self_host_us_per_step']:.0f} |"
                  for t in r["top_self_host"][: args.top]]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out if args.out is not None else ROOT / "results" / f"step_profile_{args.shape}_{device.type}"
    for r in results.values():
        r["top_self_host"] = r["top_self_host"][:60]
    write_result(out, text, {"command": command, "machine": info, "shape": [batch, channels, size, depth],
                             "steps": args.steps, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
