"""Step time and peak memory of a ResNeXt with In-place ABN: M-mode vs C-mode vs the plain twin.

One set of weights, five ways to run every batch norm + leaky ReLU of the same ResNeXt:

    iabn M               InPlaceABN, M-mode: keeps its output only; closed-form backward
    iabn M (recompute)   InPlaceABN, M-mode, generic backward: rebuild, forward again, autograd
    iabn C               InPlaceABN, C-mode: plain autograd inside the layer
    plain                BatchNorm2d + leaky ReLU (the *_bn twin): no revtrain code
    plain, in-place      BatchNorm2d + leaky ReLU(inplace=True): what a memory-aware user writes

A step is forward, cross-entropy, backward and an SGD (momentum) step. Per batch size it checks
every method's gradients against ``plain`` (relative L2 <= 1e-2 in float32, else it stops), times
``--repeats`` rounds of steps with the methods interleaved round-robin (rotating start) after
``--warmup`` untimed rounds, then measures one step per method under
``revtrain.memory.track_peak_memory``. Results: ``results/inplace_abn_<device>.md`` and ``.json``.

    python benchmarks/inplace_abn.py                                    # resnext29, CIFAR size
    python benchmarks/inplace_abn.py --batch-sizes 16 64 --repeats 7
    python benchmarks/inplace_abn.py --model resnext101 --size 224 --device cuda --batch-sizes 32 64
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from revtrain.bench.machine import busy_machine_note, machine_info
from revtrain.bench.results import write_result
from revtrain.core import set_modes
from revtrain.device import synchronize
from revtrain.layers import BatchNormLeakyReLU, InPlaceABN
from revtrain.memory import format_bytes, track_peak_memory
from revtrain.models.resnext import ResNeXt

ROOT = Path(__file__).resolve().parent.parent
SLOPE = 0.01
MODELS = {
    "resnext29": dict(units=(3, 3, 3), cardinality=8, group_width=4, stem="cifar"),
    "resnext101": dict(units=(3, 4, 23, 3), cardinality=64, group_width=2, stem="imagenet"),
}
# method -> (norm + activation layer, mode of the In-place ABN layers or None)
METHODS: dict[str, tuple[Callable[[int], nn.Module], str | None]] = {
    "iabn M": (partial(InPlaceABN, slope=SLOPE), "M"),
    "iabn M (recompute)": (partial(InPlaceABN, slope=SLOPE, closed_form_backward=False), "M"),
    "iabn C": (partial(InPlaceABN, slope=SLOPE), "C"),
    "plain": (partial(BatchNormLeakyReLU, slope=SLOPE), None),
    "plain, in-place": (partial(BatchNormLeakyReLU, slope=SLOPE, inplace=True), None),
}
REFERENCE = "plain"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="resnext29")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--size", type=int, default=32, help="input height and width")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per batch size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per batch size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: steady on a shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="path without suffix")
    return parser.parse_args(argv)


def build_models(model: str, device: torch.device, seed: int) -> dict[str, nn.Module]:
    """Every method's model, all with the weights of the first (state dicts are compatible)."""
    models: dict[str, nn.Module] = {}
    state = None
    for name, (norm_act, mode) in METHODS.items():
        torch.manual_seed(seed)
        net = ResNeXt(**MODELS[model], norm_act=norm_act, num_classes=10).to(device).train()
        if state is None:
            state = net.state_dict()
        net.load_state_dict(state)
        if mode is not None:
            set_modes(net, mode)
        models[name] = net
    return models


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def check_gradients(models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Relative L2 distance of each method's gradients (parameters and input) from plain's."""
    grads = {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        F.cross_entropy(model(xr), y).backward()
        grads[name] = torch.cat([xr.grad.flatten(), *(p.grad.flatten() for p in model.parameters())])
        model.zero_grad(set_to_none=True)
    ref = grads[REFERENCE]
    errors = {name: float((g - ref).norm() / ref.norm()) for name, g in grads.items()}
    bad = {n: e for n, e in errors.items() if e > 1e-2}
    if bad:
        raise SystemExit(f"gradients differ from {REFERENCE!r}: {bad}; not timing a broken path")
    return errors


def measure(args: argparse.Namespace, batch: int, device: torch.device) -> list[dict]:
    models = build_models(args.model, device, args.seed)
    gen = torch.Generator().manual_seed(args.seed + batch)
    x = torch.randn(batch, 3, args.size, args.size, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    errors = check_gradients(models, x, y)
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for n, m in models.items()}
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(args.warmup + args.repeats):
        order = names[round_ % len(names):] + names[: round_ % len(names)]
        for name in order:
            synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(models[name], optimizers[name], x, y)
            synchronize(device)
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    peaks = {}
    for name in names:
        optimizers[name].zero_grad(set_to_none=True)
        with track_peak_memory(device) as mem:
            train_step(models[name], optimizers[name], x, y)
        peaks[name] = mem.peak_bytes
    rows = []
    for name in names:
        paired = [t / r for t, r in zip(times[name], times[REFERENCE])]
        rows.append(dict(
            batch=batch, method=name, time_median_s=statistics.median(times[name]),
            time_min_s=min(times[name]), time_ratio=statistics.median(times[name]) / statistics.median(times[REFERENCE]),
            time_ratio_paired=statistics.median(paired),
            cpu_ratio=statistics.median(cpu[name]) / statistics.median(cpu[REFERENCE]),
            peak_bytes=peaks[name], peak_ratio=peaks[name] / peaks[REFERENCE],
            grad_rel_error=errors[name], times_s=times[name],
        ))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| batch | method | step (median) | ÷ plain | ÷ plain, paired | CPU time ÷ plain | peak memory | ÷ plain | grad rel. error |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['method']} | {r['time_median_s'] * 1e3:.0f} ms | {r['time_ratio']:.2f} "
            f"| {r['time_ratio_paired']:.2f} | {r['cpu_ratio']:.2f} | {format_bytes(r['peak_bytes'])} "
            f"| {r['peak_ratio']:.2f} | {r['grad_rel_error']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        before = machine_info(device)
        start = time.perf_counter()
        rows = [row for batch in args.batch_sizes for row in measure(args, batch, device)]
        elapsed = time.perf_counter() - start
        after = machine_info(device)
    finally:
        torch.set_num_threads(threads)
    table = format_table(rows)
    print(table)
    command = "python " + shlex.join([sys.argv[0] if argv is None else "benchmarks/inplace_abn.py",
                                      *(sys.argv[1:] if argv is None else argv)])
    note = busy_machine_note(before, after, "Read the ratios (paired and CPU time) rather than absolute times.")
    out = args.out or ROOT / "results" / f"inplace_abn_{device.type}"
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = MODELS[args.model]
    md = [
        "# In-place ABN benchmark",
        "",
        f"`{args.model}` ({cfg}), input 3x{args.size}x{args.size}, float32, {args.threads} thread(s) "
        f"on {device}. Step = forward + cross-entropy + backward + SGD step. Median of {args.repeats} "
        f"rounds after {args.warmup} warm-up round(s), methods interleaved round-robin; 'paired' = "
        "median of per-round ratios. Peak = tensor bytes allocated during one step above what was "
        "live before it (parameters excluded; gradients, optimizer temporaries and activations "
        "included), `revtrain.memory`. Gradients checked against `plain` before timing.",
        "",
        table,
        "",
        *( [f"**Note:** {note}", ""] if note else [] ),
        f"Machine: {before['cpu']}, {before['cpu_count']} cores, torch {before['torch']}. "
        f"Load average before {before['load_average']}, after {after['load_average']}. "
        f"Took {elapsed:.0f} s.",
        "",
        f"Command: `{command}`",
        "",
    ]
    write_result(out, "\n".join(md), dict(
        config=vars(args) | {"out": str(out)}, model=cfg, rows=rows, machine_before=before,
        machine_after=after, command=command, elapsed_s=elapsed, note=note))
    return rows


if __name__ == "__main__":
    main()
