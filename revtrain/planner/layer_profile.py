"""Costs of the plain (non-reversible) layers' options: bytes freed and seconds spent.

For each plain layer (:func:`~revtrain.planner.recompute.plain_layers`) and each option besides
keeping it (``"recompute"``; ``"offload"`` on CUDA):

* **bytes** — in context, as for a reversible block's ``m``: one forward of the whole model with
  the loss in baseline-M (every block in M-mode, every plain layer kept), then one per layer and
  option with only that layer switched; the memory tracker reads the bytes each forward left
  live. Where that decreases, a whole step with the layer switched is measured too, and the
  option frees the smaller of the two decreases (end of forward, step peak): a layer's
  activations may not be live where the step peaks, and recomputing re-creates them in backward;
* **seconds** — the layer alone on the activation the model gave it (taken by a pre-hook during
  one no-grad forward), forward and backward, its options in **paired rounds**: one run of each
  per round, the order rotating, so a change of load hits all alike. Each round gives a
  difference (option minus keep); the cost is their median, with the 95% interval of
  :func:`revtrain.timing.median_interval`; rounds go on until the
  :class:`~revtrain.planner.block_timing.TimingRule` is met for every option. Recomputing does
  everything keeping does plus one more forward, so a median <= 0 is noise: one forward of the
  layer is used instead.

Only layers whose options free bytes are timed; the others could only cost time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from revtrain.core import set_modes
from revtrain.memory import track_peak_memory
from revtrain.planner.block_timing import TimingRule, time_forward_backward
from revtrain.planner.data import LayerProfile
from revtrain.planner.measure import measure_steps
from revtrain.planner.recompute import plain_layers, set_layer_options
from revtrain.planner.setup import MeasurementSetup, call_model
from revtrain.timing import median_interval, timer

__all__ = ["layer_options_offered", "profile_plain_layers"]


def layer_options_offered(device: torch.device) -> tuple[str, ...]:
    """The options besides keeping that the planner weighs for plain layers on ``device``:
    recomputation everywhere, offloading to host memory on CUDA only (on the CPU it frees nothing)."""
    return ("recompute", "offload") if device.type == "cuda" else ("recompute",)


def profile_plain_layers(
    setup: MeasurementSetup,
    rule: TimingRule | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[LayerProfile]:
    """Bytes and seconds of every plain layer's options (module docstring), for the layers whose
    options free bytes, in module order."""
    options = layer_options_offered(setup.device)
    names = [name for name, _ in plain_layers(setup.model)]
    if not names:
        return []
    saves = _bytes_freed(setup, names, options)
    useful = [n for n in names if any(saves[n][o] > 0 for o in options)]
    if not useful:
        return []
    timings = _time_layers(setup, useful, options, rule or TimingRule(), progress)
    out = []
    for name in useful:
        if name not in timings:
            continue
        t = timings[name]
        rec = t["recompute"]
        kwargs: dict[str, Any] = {}
        if "offload" in options:
            off = t["offload"]
            kwargs = dict(offload_s=off[0], offload_saves_bytes=saves[name]["offload"], offload_low_s=off[1],
                          offload_high_s=off[2])
        out.append(LayerProfile(
            name=name, recompute_s=rec[0], recompute_saves_bytes=saves[name]["recompute"], recompute_low_s=rec[1],
            recompute_high_s=rec[2], pairs=int(t["pairs"][0]), **kwargs,
        ))
    return out


def _bytes_freed(setup: MeasurementSetup, names: list[str], options: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Per layer and option, the bytes it frees: the smaller of the decrease of the bytes left
    live at the end of the forward and the decrease of the whole step's peak (the layer's
    activations may not be live where the step peaks, and recomputing re-creates them there)."""
    model = setup.model
    setup.reset()
    model.train()
    set_modes(model, "M")
    set_layer_options(model, "keep")
    base = _live_after_forward(setup)
    out: dict[str, dict[str, int]] = {}
    for name in names:
        out[name] = {}
        for option in options:
            set_layer_options(model, {name: option})
            out[name][option] = max(0, base - _live_after_forward(setup))
        set_layer_options(model, {name: "keep"})
    settings = {"M": "M", **{f"{n}/{o}": {n: o} for n in names for o in options if out[n][o] > 0}}
    peaks = measure_steps(setup, settings, repeats=0, warmup=1)
    for key, measured in peaks.items():
        if key != "M":
            n, o = key.split("/")
            out[n][o] = max(0, min(out[n][o], peaks["M"].peak_bytes - measured.peak_bytes))
    setup.reset()
    return out


def _live_after_forward(setup: MeasurementSetup) -> int:
    with track_peak_memory(setup.device) as mem:
        loss = setup.loss()
        live = mem.end_bytes
    del loss
    return live


def _time_layers(
    setup: MeasurementSetup, names: list[str], options: tuple[str, ...], rule: TimingRule,
    progress: Callable[[str], None] | None,
) -> dict[str, dict[str, tuple[float, ...]]]:
    dev = setup.device
    start = timer(dev)
    model = setup.model
    layers = dict(plain_layers(model))
    by_id = {id(layers[n]): n for n in names}
    result: dict[str, dict[str, tuple[float, ...]]] = {}
    settings = ("keep", *options)

    def run(name: str, module: torch.nn.Module, args: tuple, kwargs: dict, option: str) -> tuple[float, float]:
        set_layer_options(model, {name: option})
        return time_forward_backward(module.forward, args, kwargs, dev, start)

    def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        name = by_id.get(id(module))
        if name is None or name in result:
            return
        for _ in range(rule.warmup_pairs):
            for option in settings:
                run(name, module, args, kwargs, option)
        diffs: dict[str, list[float]] = {o: [] for o in options}
        forwards: list[float] = []
        k = 0
        while not all(rule.settled(d) for d in diffs.values()):
            order = settings[k % len(settings):] + settings[: k % len(settings)]
            times = {}
            for option in order:
                f, b = run(name, module, args, kwargs, option)
                times[option] = f + b
                if option == "keep":
                    forwards.append(f)
            for o in options:
                diffs[o].append(times[o] - times["keep"])
            k += 1
        set_layer_options(model, {name: "keep"})
        fallback = statistics.median(forwards)
        entry: dict[str, tuple[float, ...]] = {"pairs": (k,)}
        for o in options:
            iv = median_interval(diffs[o])
            entry[o] = (iv.median if iv.median > 0 else fallback, iv.low, iv.high)
        result[name] = entry
        if progress is not None:
            rec = entry["recompute"]
            progress(f"  recompute {name}: +{rec[0] * 1e3:.2f} ms [{rec[1] * 1e3:.2f}, {rec[2] * 1e3:.2f}] ({k} rounds)")

    setup.reset()
    model.train()
    handles = [layers[n].register_forward_pre_hook(pre, with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            call_model(model, setup.inputs)
    finally:
        for h in handles:
            h.remove()
        setup.reset()
    return result

