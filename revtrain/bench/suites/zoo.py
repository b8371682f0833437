"""Zoo suite: every reversible model of the registry in M-mode and C-mode, and its plain twin.

Whole SGD steps (forward, loss, backward, ``optimizer.step()``) with the planner's measuring
function (:func:`revtrain.planner.measure_steps`): M- and C-mode steps of the same model alternate
in rounds (the order rotating, each timed step right after an untimed one of its own mode), then
the plain twin on the same batch. Step memory is the planner's: the peak of one step, parameters,
gradients and optimizer state included.

For models with a :class:`~revtrain.ReversibleSequence` a phase split (C, M, M without the check and
a forward without a graph, one after the other in each round, the order rotating, each timed pass
right after an untimed one of its own) gives the rebuild floors: ``1 +``
one forward of the reversible blocks without / with a graph over C-mode's forward plus backward,
what M / C would be if running those blocks once more were all M-mode added.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import torch

from revtrain import ReversibleSequence, list_models, model_info, set_modes, set_rebuild_checks
from revtrain.bench.report import Column, Report, Table, interval_cells
from revtrain.device import synchronize
from revtrain.models import create_model_for, input_spec
from revtrain.planner import measure_steps, prepare
from revtrain.tasks import task_for
from revtrain.timing import block_ratios, median_interval

CASES: dict[str, tuple[tuple[tuple[int, ...], int], ...]] = {
    "revnet38": (((1, 8, 8), 64), ((3, 32, 32), 128)),
    "revnet110": (((1, 8, 8), 64), ((3, 32, 32), 128)),
    "revnet164": (((3, 32, 32), 32),),
    "revnet18": (((3, 32, 32), 32),),
    "revnet34": (((3, 32, 32), 32),),
    "revnet50": (((3, 32, 32), 32),),
    "revnet18_imagenet": (((3, 64, 64), 8),),
    "revnet34_imagenet": (((3, 64, 64), 8),),
    "revnet50_imagenet": (((3, 64, 64), 8),),
    "revnet104": (((3, 64, 64), 8),),
    "resnext29_iabn": (((3, 32, 32), 16),),
    "resnext101_iabn": (((3, 64, 64), 4),),
    "revvit_digits": (((1, 8, 8), 64),),
    "revvit_cifar": (((3, 32, 32), 32),),
    "revformer_tiny": (((16,), 32),),
    "revformer_small": (((128,), 16),),
    "revformer_enwik8": (((512,), 2),),
}
"""Input shape and batch per model on a CPU: digits (1×8×8) and CIFAR sizes, ImageNet models at
64×64, language models at a context the CPU can step; ``--shapes`` replaces them."""
QUICK_CASES = {"revnet38": (((1, 8, 8), 4),), "revformer_tiny": (((16,), 4),)}


def twin_of(name: str) -> str:
    """The plain twin of reversible zoo model ``name`` (same recipe, ordinary residuals)."""
    if name.startswith("revnet"):
        twin = {"revnet38": "resnet32", "revnet104": "resnet101"}.get(name, name.replace("revnet", "resnet", 1))
    elif name.endswith("_iabn"):
        twin = name.removesuffix("_iabn") + "_bn"
    elif name.startswith("revformer_"):
        twin = name.replace("revformer_", "transformer_", 1)
    elif name.startswith("revvit_"):
        twin = name.replace("revvit_", "vit_", 1)
    else:
        twin = ""
    if twin not in list_models():
        raise ValueError(f"{name} has no plain twin in the zoo; the zoo suite measures RevNets, ResNeXt (iabn), "
                         "reversible Transformers and ViTs")
    return twin


def _parse_case(text: str, name: str) -> tuple[tuple[int, ...], int]:
    """``SIDE:BATCH`` (images: C is the model's, or 1 for 8×8) or ``LENGTH:BATCH`` (tokens)."""
    try:
        size, batch = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"a zoo shape is SIDE:BATCH (images) or LENGTH:BATCH (tokens), e.g. 32:128; got {text!r}") from None
    spec = model_info(name).inputs
    if spec.kind == "tokens":
        return (size,), batch
    return (1 if size == 8 else spec.shape[0], size, size), batch


def run(options, device: torch.device, out: Path, log) -> Report:
    names = options.models or tuple(QUICK_CASES if options.quick else CASES)
    cases = []
    for name in names:
        if not model_info(name).reversible:
            raise ValueError(f"{name} has no reversible layers; the zoo suite measures reversible models "
                             f"({', '.join(CASES)}) against their twins")
        shapes = [_parse_case(s, name) for s in options.shapes] if options.shapes else \
            ((QUICK_CASES if options.quick else CASES).get(name) or ((model_info(name).inputs.shape, 8),))
        cases += [(name, shape, batch) for shape, batch in shapes]
    repeats = options.pick(7, 2)
    warmup = options.warmup_steps()
    phase_rounds = 2 if options.quick else 10
    steps, phases = [], []
    for name, shape, batch in cases:
        row, split = measure_case(name, shape, batch, device, repeats, warmup, phase_rounds)
        steps.append(row)
        if split:
            phases.append(split)
        log(f"{name} {row['input']} batch {batch}: M/C {row['M_over_C']:.3f}, M/twin {row['M_over_twin']:.3f}, "
            f"peaks M {row['M_peak_bytes']} C {row['C_peak_bytes']} twin {row['twin_peak_bytes']}")
    step_table = Table(
        "steps", "Whole SGD steps: M-mode, C-mode and the plain twin",
        [Column("model", "model"), Column("input", "input"), Column("batch", "batch", "int"),
         Column("M_step_s", "M step", "ms"), Column("C_step_s", "C step", "ms"),
         Column("M_over_C", "M / C [interval]", "interval"),
         Column("twin", "twin"), Column("twin_step_s", "twin step", "ms"), Column("M_over_twin", "M / twin", "ratio"),
         Column("M_peak_bytes", "M step memory", "bytes"), Column("C_peak_bytes", "C step memory", "bytes"),
         Column("twin_peak_bytes", "twin step memory", "bytes")],
        steps,
        note=(f"Medians of whole SGD steps, M and C alternating in rounds (the order rotating, each timed step right after an untimed one of its own setting, as in training with it) ({repeats} at least, up to {2 * repeats} "
              "until each median is known to 2%); M / C: median of the per-round ratios with a distribution-free interval of "
              "at least 95% where the rounds allow (`revtrain.timing.median_interval`). Step memory: the peak of one step with "
              "parameters, gradients and optimizer state (the planner's step memory)."),
    )
    phase_table = Table(
        "phases", "Where M-mode's time goes, and the rebuild floors",
        [Column("model", "model"), Column("input", "input"), Column("batch", "batch", "int"),
         Column("C_forward_s", "C fwd", "ms"), Column("C_backward_s", "C bwd", "ms"),
         Column("C_blocks_s", "C fwd in blocks", "ms"), Column("M_forward_s", "M fwd", "ms"),
         Column("M_backward_s", "M bwd", "ms"), Column("M_nocheck_backward_s", "M bwd, no check", "ms"),
         Column("M", "M / C", "ratio3"), Column("M_nocheck", "M / C, no check", "ratio3"),
         Column("floor", "rebuild floor, no graph", "ratio3"), Column("floor_graph", "with graph", "ratio3")],
        phases,
        note=(f"Medians over {phase_rounds} rounds after one untimed, the settings one after the other in each round (the order rotating, each timed pass right after an untimed one of its own setting), "
              "no optimizer step. Ratios are of forward plus backward to C-mode's; a floor is 1 + one forward of the "
              "reversible blocks (without / with a graph) over C-mode's forward plus backward."),
    )
    return Report("zoo", "Zoo: every reversible model in M- and C-mode against its plain twin", {},
                  [step_table, phase_table], intro=_INTRO)


_INTRO = ("Every reversible model of the registry at a small input (digits 8×8, CIFAR 32×32, ImageNet models at "
          "64×64 on a CPU), its plain twin (`resnet*`, `*_bn`, `transformer_*`, `vit_*`) on the same batch.")


def measure_case(name: str, shape: tuple[int, ...], batch: int, device: torch.device, repeats: int, warmup: int,
                 phase_rounds: int) -> tuple[dict, dict | None]:
    """One row of the step table and, for models with a reversible sequence, one of the phase table."""
    spec = input_spec(name, input_size=shape, num_classes=10 if model_info(name).inputs.kind == "image" else None)
    example = spec.example(batch, device, seed=0)
    loss = task_for(spec).loss
    torch.manual_seed(0)
    model = create_model_for(name, spec)
    split = None
    with prepare(model, example, loss_fn=loss, device=device, repeats=repeats, warmup=warmup,
                 max_repeats=2 * repeats) as setup:
        modes = measure_steps(setup, {"M": "M", "C": "C"})
        if any(isinstance(m, ReversibleSequence) for m in model.modules()):
            split = phase_times(setup, phase_rounds)
    twin_name = twin_of(name)
    torch.manual_seed(0)
    twin = create_model_for(twin_name, spec)
    with prepare(twin, example, loss_fn=loss, device=device, repeats=repeats, warmup=warmup,
                 max_repeats=2 * repeats) as setup:
        plain = measure_steps(setup, {"plain": None})["plain"]
    m, c = modes["M"], modes["C"]
    label = "×".join(map(str, shape[1:])) if len(shape) == 3 else f"{shape[0]} tokens"
    row = {
        "model": name, "input": label, "batch": batch, "twin": twin_name,
        "M_step_s": m.step_time_s, "C_step_s": c.step_time_s, "twin_step_s": plain.step_time_s,
        **interval_cells("M_over_C", median_interval(block_ratios(m.times_s, c.times_s, 1))),
        "M_over_twin": m.step_time_s / plain.step_time_s, "C_over_twin": c.step_time_s / plain.step_time_s,
        "M_peak_bytes": m.peak_bytes, "C_peak_bytes": c.peak_bytes, "twin_peak_bytes": plain.peak_bytes,
        "rounds": len(m.times_s),
    }
    if split is None:
        return row, None
    ratios = floors(split)
    flat = {f"{setting}_{part}": value for setting, parts in split.items() for part, value in parts.items()}
    phases = {"model": name, "input": label, "batch": batch,
              **{k.replace(", no check", "_nocheck").replace(", no graph", "_nograph"): v for k, v in flat.items()},
              **{k.replace(", no check", "_nocheck"): v for k, v in ratios.items()}}
    return row, phases


PHASE_SETTINGS = (("C", "C", None), ("M", "M", None), ("M, no check", "M", 0))
"""The phase split's settings: name, mode, rebuild check interval (None: the default schedule)."""


def phase_times(setup, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds of a step's parts in each of :data:`PHASE_SETTINGS`, one step of each
    per round (the order rotating, each right after an untimed one of its own) after one
    untimed round, plus a forward without a graph (``"C, no graph"``):
    ``forward_s`` (with the loss), ``backward_s`` and ``blocks_s``, the part of the forward
    spent in the reversible blocks (hooks around each top-level ``ReversibleSequence``). In
    C-mode that is one forward of the blocks with a graph, what M-mode's backward runs again to
    rebuild; without a graph, what M-mode's forward runs. No optimizer step: the weights stay
    as prepared, so every round times the same computation."""
    model, sync = setup.model, functools.partial(synchronize, setup.device)
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    inner = {id(c) for m in sequences for c in m.modules() if c is not m and isinstance(c, ReversibleSequence)}
    spent = [0.0]
    started: list[float] = []

    def before(*_):
        sync()
        started.append(time.perf_counter())

    def after(*_):
        sync()
        spent[0] += time.perf_counter() - started.pop()

    handles = []
    for m in sequences:
        if id(m) not in inner:
            handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    settings = (*PHASE_SETTINGS, ("C, no graph", "C", None))
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in settings}
    setup.reset()
    model.train()
    try:
        for r in range(rounds + 1):
            # Rotated each round, and each timed pass right after an untimed one of its own
            # setting: a pass is faster or slower by what the pass before it left in the
            # allocator, which a fixed order charged to whichever setting came after C-mode.
            for name, mode, every in settings[r % len(settings):] + settings[: r % len(settings)]:
                set_modes(model, mode)
                set_rebuild_checks(model, every)
                graph = name != "C, no graph"
                _timed_pass(setup, graph, sync, spent)
                parts = _timed_pass(setup, graph, sync, spent)
                if r:
                    times[name].append(parts)
    finally:
        for h in handles:
            h.remove()
        set_rebuild_checks(model, None)
        setup.reset()
    return {name: {key: statistics.median(t[k] for t in parts) for k, key in enumerate(("forward_s", "backward_s", "blocks_s"))}
            for name, parts in times.items()}


def _timed_pass(setup, graph: bool, sync, spent: list[float]) -> tuple[float, float, float]:
    """Seconds of one forward (with the loss), its backward (0 without a graph) and the part of
    the forward spent in the reversible blocks."""
    setup.model.zero_grad(set_to_none=True)
    spent[0] = 0.0
    sync()
    t0 = time.perf_counter()
    with torch.set_grad_enabled(graph):
        loss = setup.loss()
    sync()
    t1 = time.perf_counter()
    if graph:
        loss.backward()
        sync()
    t2 = time.perf_counter() if graph else t1  # nothing to backpropagate
    return t1 - t0, t2 - t1, spent[0]


def floors(phases: dict[str, dict[str, float]]) -> dict[str, float]:
    """Ratios of forward plus backward to C-mode's, from the phase split's medians: M, M
    without the check, and the two rebuild floors, ``1 +`` one forward of the reversible
    blocks without / with a graph over C-mode's forward plus backward."""
    c = phases["C"]["forward_s"] + phases["C"]["backward_s"]

    def total(name: str) -> float:
        return phases[name]["forward_s"] + phases[name]["backward_s"]

    return {
        "M": total("M") / c,
        "M, no check": total("M, no check") / c,
        "floor": 1 + phases["C, no graph"]["blocks_s"] / c,
        "floor_graph": 1 + phases["C"]["blocks_s"] / c,
    }
