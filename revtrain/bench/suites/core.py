"""Core suite: a reversible stack trained every way (plain autograd, M-mode, C-mode,
``torch.utils.checkpoint``, and the peer libraries revlib, memcnn, reformer-pytorch and
RevTorch when installed) across shapes, from host-bound to large.

Per shape the stack benchmark (:mod:`revtrain.bench.stack`) builds every method on one set of
F/G weights, checks each method's gradients against plain autograd, times ``repeats`` rounds of
one step per method (the order rotating, each right after an untimed step of its own) and
measures one step's peak memory. Ratios are per round (both methods timed in the same round): a
median with a distribution-free interval of at least 95% (:func:`revtrain.timing.median_interval`),
so a verdict is given only where the whole interval lies on one side of 1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from revtrain.bench.peers import PEERS, installed_peers, peer_status
from revtrain.bench.report import Column, Report, Table, interval_cells
from revtrain.bench.stack import EXTRA_METHODS, OURS, StackBenchConfig, parse_stack_shape, run_stack_benchmark
from revtrain.timing import block_ratios, median_interval


SHAPES = ("8x16x8x16", "16x64x16x16", "32x64x32x4", "32x64x32x16", "32x64x32x32", "64x128x8x8",
          "8x128x32x8", "64x16x32x8")
"""BATCHxCHANNELSxSIZExDEPTH: host-bound (8x16x8, 16 blocks) to large, and depths 4 to 32 at 32x64x32."""
CUDA_SHAPES = SHAPES + ("256x256x32x8",)
"""On a GPU also a shape where the device, not the host, is the bottleneck."""
QUICK_SHAPES = ("8x16x8x16", "16x32x16x8")

_VERDICTS = {"below": "faster", "above": "slower", "tie": "no difference shown"}


def run(options, device: torch.device, out: Path, log) -> Report:
    texts = options.shapes or (QUICK_SHAPES if options.quick else CUDA_SHAPES if device.type == "cuda" else SHAPES)
    shapes = [parse_stack_shape(s) for s in texts]
    unknown = [m for m in options.methods if m not in OURS + PEERS + EXTRA_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(OURS + PEERS + EXTRA_METHODS)}")
    # Exactly the methods asked for (a peer that is named but not installed is refused by the
    # config), with plain first: every ratio is taken against it.
    methods = ["plain", *dict.fromkeys(m for m in options.methods if m != "plain")] if options.methods else \
        [*OURS, *installed_peers()]
    repeats = options.pick(11, 6)
    warmup = options.warmup_steps()
    block = 4 if "M-check4" in methods else 1
    if repeats < 2 * block:
        raise ValueError(f"--repeats must be at least {2 * block} here (ratios are paired over blocks of {block} rounds)")
    steps, versus = [], []
    for batch, channels, size, depth in shapes:
        config = StackBenchConfig(batch=batch, channels=channels, size=size, depths=(depth,), methods=tuple(methods),
                                  repeats=repeats, warmup=warmup, device=str(device))
        shape = f"{batch}x{channels}x{size}x{depth}"
        rows = run_stack_benchmark(config, log=lambda line, shape=shape: log(f"{shape}: {line}"))
        times = {r.method: r.times_s for r in rows}
        plain = next(r for r in rows if r.method == "plain")
        for r in rows:
            steps.append({
                "shape": shape, "batch": batch, "channels": channels, "size": size, "depth": depth,
                "method": r.method, "step_s": r.time_median_s, "step_iqr_s": r.time_iqr_s,
                **interval_cells("time_x_plain", median_interval(block_ratios(r.times_s, plain.times_s, block))),
                "cpu_time_x_plain": r.cpu_time_ratio, "peak_bytes": r.peak_bytes, "peak_x_plain": r.peak_ratio,
                "grad_rel_err": r.grad_rel_err, "rounds": len(r.times_s),
            })
        for other in methods if "M" in times else ():
            if other == "M":
                continue
            found = median_interval(block_ratios(times["M"], times[other], block))
            versus.append({"shape": shape, "versus": other, **interval_cells("M_over", found),
                           "verdict": _VERDICTS[found.verdict()], "rounds": len(times["M"]) // block})
    coverage = median_interval([0.0] * (repeats // block)).coverage
    notes = [p for m in PEERS if (p := peer_status(m))]
    step_table = Table(
        "steps", "Step time and peak memory per method and shape",
        [Column("shape", "batch×ch×size×depth"), Column("method", "method"), Column("step_s", "median step", "ms"),
         Column("time_x_plain", "time × plain [interval]", "interval"), Column("cpu_time_x_plain", "CPU time × plain", "ratio"),
         Column("peak_bytes", "peak", "bytes"), Column("peak_x_plain", "peak × plain", "ratio"),
         Column("grad_rel_err", "grad rel. err", "sci")],
        steps,
        note=("Step = forward + mean-square loss + backward of a stack of additive coupling blocks, F and G = "
              "Conv3x3 (no bias) + BatchNorm + ReLU on half the channels; every method trains the same weights on the "
              f"same batch. Time × plain: median of the per-round ratios over {repeats} rounds [interval of "
              f"{coverage:.1%}]. Peak: tensor bytes of one step, parameter gradients included (CPU: dispatch tracker; "
              "CUDA: allocator). Grad rel. err: ||g − g_plain|| / ||g_plain|| over all gradients, checked before timing."),
        merge_key=("shape", "method"),  # a part run with other --methods adds its rows
    )
    versus_table = Table(
        "m_versus", "M-mode head to head", [Column("shape", "batch×ch×size×depth"), Column("versus", "against"),
                                            Column("M_over", "M / it [interval]", "interval"), Column("verdict", "verdict")],
        versus,
        note=("Per-round ratio of M-mode's step to the other method's (both timed in the same round"
              + (f", totals over blocks of {block} rounds" if block > 1 else "") + "): *faster* / *slower* where the "
              "whole interval lies below / above 1."),
        merge_key=("shape", "versus"),
    )
    return Report("core", "Core: a reversible stack, every method × shapes", {}, [step_table, versus_table],
                  intro=_INTRO, notes=notes)


_INTRO = (
    "Per shape, every method is built on one set of F/G weights, its gradients are checked against plain "
    "autograd, then one step of each method is timed per round (the order rotating, each right after an untimed step of the same method, as in training with it) and one step's peak memory "
    "is measured. Ratios are per round, both methods timed in the same round: a median with a distribution-free "
    "interval (`revtrain.timing.median_interval`), so a verdict is given only where the whole interval lies on "
    "one side of 1. Peer libraries are built on the very same F/G modules (`revtrain/bench/peers.py`)."
)
