"""Step time and peak memory of a ResNeXt with In-place ABN: M-mode vs C-mode vs the plain twin.

One set of weights, five ways to run every batch norm + leaky ReLU of the same ResNeXt:

    iabn M               InPlaceABN, M-mode: keeps its output only; closed-form backward
    iabn M (recompute)   InPlaceABN, M-mode, generic backward: rebuild, forward again, autograd
    iabn C               InPlaceABN, C-mode: plain autograd inside the layer
    plain                BatchNorm2d + leaky ReLU (the *_bn twin): no revtrain code
    plain, in-place      BatchNorm2d + leaky ReLU(inplace=True): what a memory-aware user writes

A step is forward, cross-entropy, backward and an SGD (momentum) step. Per batch size it checks
every method's gradients against ``plain`` in float64 on float64 copies of the models (relative
L2 <= 1e-9, else it stops: in float32 the leaky ReLU's kink makes a network's gradients jump
when rounding moves a value across zero, so float32 gradients of two correct methods can differ
by 1e-3, and by more with TF32), times
``--repeats`` rounds of steps with the methods interleaved round-robin (rotating start) after
``--warmup`` untimed rounds, then measures one step per method under
``revtrain.memory.track_peak_memory``.

    revtrain bench inplace_abn                                   # resnext29, CIFAR size
    revtrain bench inplace_abn --shapes 16 64 --repeats 7        # batch sizes
    revtrain bench inplace_abn --models resnext101 --device cuda --shapes 32 64
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from revtrain import set_modes
from revtrain.bench.report import Column, Report, Table
from revtrain.device import synchronize
from revtrain.layers import BatchNormLeakyReLU, InPlaceABN
from revtrain.memory import track_peak_memory
from revtrain.models.resnext import ResNeXt

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
    """Relative L2 distance of each method's gradients (parameters and input) from plain's, in
    float64 on copies of the models (the leaky ReLU's kink makes float32 gradients jump, see the
    module docstring); stops the suite where a method is off."""
    grads = {}
    x64 = x.double()
    for name, model in models.items():
        twin = copy.deepcopy(model).double()
        xr = x64.clone().requires_grad_(True)
        F.cross_entropy(twin(xr), y).backward()
        grads[name] = torch.cat([xr.grad.flatten(), *(p.grad.flatten() for p in twin.parameters())])
        del twin
    ref = grads[REFERENCE]
    errors = {name: float((g - ref).norm() / ref.norm()) for name, g in grads.items()}
    bad = {n: e for n, e in errors.items() if e > 1e-9}
    if bad:
        raise SystemExit(f"float64 gradients differ from {REFERENCE!r}: {bad}; not timing a broken path")
    return errors


def measure(args: SimpleNamespace, batch: int, device: torch.device) -> list[dict]:
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


def run(options, device: torch.device, out: Path, log) -> Report:
    model = options.models[0] if options.models else "resnext29"
    if model not in MODELS or len(options.models) > 1:
        raise ValueError(f"the inplace_abn suite measures one of {', '.join(MODELS)}; got {', '.join(options.models)}")
    quick = options.quick
    args = SimpleNamespace(model=model, size=8 if quick else 32 if model == "resnext29" else 224, seed=0,
                           repeats=options.pick(5, 1), warmup=options.warmup_steps())
    batches = tuple(int(s) for s in options.shapes) or ((2,) if quick else (16, 32))
    rows = []
    for batch in batches:
        rows += measure(args, batch, device)
        log(f"batch {batch}: " + ", ".join(f"{r['method']} {r['time_ratio_paired']:.2f}x" for r in rows[-len(METHODS):]))
    for r in rows:
        r.pop("times_s")
    table = Table(
        "steps", "Step time and peak memory per method",
        [Column("batch", "batch", "int"), Column("method", "method"), Column("time_median_s", "median step", "ms"),
         Column("time_ratio", "÷ plain", "ratio"), Column("time_ratio_paired", "÷ plain, paired", "ratio"),
         Column("cpu_ratio", "CPU time ÷ plain", "ratio"), Column("peak_bytes", "peak memory", "bytes"),
         Column("peak_ratio", "÷ plain", "ratio"), Column("grad_rel_error", "grad rel. error (float64)", "sci")],
        rows)
    intro = (f"`{model}` ({MODELS[model]}), input 3×{args.size}×{args.size}, float32. Step = forward + cross-entropy "
             f"+ backward + SGD step. Median of {args.repeats} rounds after {args.warmup} warm-up round(s), methods "
             "interleaved round-robin; 'paired' = median of per-round ratios. Peak = tensor bytes allocated during one "
             "step above what was live before it (parameters excluded; gradients, optimizer temporaries and "
             "activations included). Gradients checked against `plain` before timing.")
    return Report("inplace_abn", "In-place ABN: ResNeXt in M- and C-mode against BatchNorm + LeakyReLU", {},
                  [table], intro=intro)
