"""One definition of step memory: the trainer's end-of-run report measures what the planner plans for."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from revtrain.memory import format_step_memory
from revtrain.planner import measure_steps, prepare

from .helpers import assert_same, snapshot, tiny_batch, tiny_model


def test_the_trainers_step_memory_is_the_planners_peak():
    from revtrain.train import measure_step_memory

    model, batch = tiny_model(), tiny_batch()
    modes = {name: ("C" if i % 2 else "M") for i, name in enumerate(
        n for n, m in model.named_modules() if type(m).__name__ == "ReversibleBlock")}
    with prepare(model, batch, repeats=0, warmup=1) as setup:
        planner = measure_steps(setup, {"run": modes, "plain": "C"})
    before = snapshot(model)
    report = measure_step_memory(model, batch, modes, torch.device("cpu"), nullcontext)
    assert_same(before, snapshot(model))
    assert (report.run_bytes, report.plain_bytes) == (planner["run"].peak_bytes, planner["plain"].peak_bytes)
    # Parameters, gradients, momentum and the batch are part of it, not only the activations.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.run_bytes > 3 * params + sum(t.numel() * t.element_size() for t in batch)
    line = format_step_memory(8, modes, report.run_bytes, report.plain_bytes)
    assert line.startswith("step memory (batch 8, 3 M / 2 C of 5 reversible blocks): ")
    assert "plain backprop needs" in line


def test_plain_backprop_keeps_the_layers_a_plan_recomputes():
    """With a plan's plain layer recomputed, "plain backprop needs" is still plain backprop: the
    same bytes as the model with every layer kept (and the model keeps its plan's option)."""
    from revtrain.planner.recompute import get_layer_options, plain_layers, set_layer_options
    from revtrain.train import measure_step_memory

    model, batch = tiny_model(), tiny_batch()
    modes = dict.fromkeys((n for n, m in model.named_modules() if type(m).__name__ == "ReversibleBlock"), "M")
    kept = measure_step_memory(model, batch, modes, torch.device("cpu"), nullcontext)
    first = plain_layers(model)[0][0]
    set_layer_options(model, {first: "recompute"})
    planned = measure_step_memory(model, batch, modes, torch.device("cpu"), nullcontext)
    assert planned.run_bytes < kept.run_bytes  # the recomputed layer's activations are not kept
    assert planned.plain_bytes == kept.plain_bytes
    assert get_layer_options(model)[first] == "recompute"
