"""``revtrain plan``: profile a zoo model, solve for a budget, report predicted and measured costs.

The options are the fields of :class:`PlanConfig` (the CLI derives them, :mod:`revtrain.options`);
every option is checked when the config is built, before anything is measured. Example::

    revtrain plan --model revnet38 --batch-size 64 --input-shape 1 8 8 --num-classes 10 --budget 9MiB
    revtrain plan --model revnet38 --budget 50% --sweep 32,64,128,256 --plots-dir plots/

The example batch comes from the model's registry entry (:func:`revtrain.models.input_spec`), the
model is built for it (:func:`revtrain.models.create_model_for`: a token model's context is the
sequence length) and the loss comes from the task that trains such inputs
(:func:`revtrain.tasks.task_for`). Any reversible layer is planned: RevNet and Transformer
coupling blocks, In-place ABN layers (``revtrain plan --model revformer_small --input-shape 256``,
``revtrain plan --model resnext29_iabn``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

import torch

from revtrain.core import set_rebuild_checks
from revtrain.device import float_dtype, resolve_device
from revtrain.errors import RevtrainError
from revtrain.planner.budget import check_budget
from revtrain.planner.pipeline import run_pipeline
from revtrain.planner.profile_options import ProfileOptions
from revtrain.planner.report import report_plan, report_sweep
from revtrain.planner.setup import prepare
from revtrain.planner.sweep import parse_batch_sizes, sweep_setup

__all__ = ["PlanConfig", "PlanConfigError", "run_plan"]


class PlanConfigError(RevtrainError, ValueError):
    """An option of ``revtrain plan`` has a value that cannot work; the message says which."""


@dataclass(kw_only=True)
class PlanConfig(ProfileOptions):
    """What ``revtrain plan`` plans, for which budget, and how carefully it measures (the options it
    shares with ``revtrain train --budget`` are those of :class:`ProfileOptions`)."""

    model: str
    """Zoo model name (`revtrain models` lists them), e.g. revnet110."""
    batch_size: int = 128
    """Batch size to plan for; a plan holds only at this batch size."""
    budget: str | None = None
    """Step memory allowed: bytes, 6GiB, 512MB, a fraction 0.5 or 50% of the device's memory (CPU: of
    available RAM); default all the device can give now."""
    input_shape: tuple[int, ...] | None = None
    """One sample's shape: C H W for an image model, e.g. 3 32 32; the sequence length T for a token
    model, e.g. 512, which the model is built for (default: the model's, from the registry). A plan
    holds only for this shape."""
    num_classes: int | None = None
    """Classifier outputs, or the vocabulary of a token model (default: the model's)."""
    device: str = "auto"
    """auto (CUDA when present), cpu, cuda or cuda:N."""
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    """Parameter dtype (and input dtype of image models)."""
    out: str | None = "plan.json"
    """Where to write the plan JSON."""
    profile_out: str | None = None
    """Also write the profile JSON here."""
    overwrite: bool = False
    """Replace --out and --profile-out files that exist already (without it, an existing file is refused before anything is measured)."""
    sweep: str | None = None
    """Also sweep batch sizes, 32,64,128,256 or 32:256:32, with the same pipeline, and plot the plans
    (paper §3.4)."""
    plots_dir: str | None = None
    """Where --sweep writes its PNGs and JSON (default: next to --out)."""
    confirm: int = 2
    """--sweep: plan and measure this many of the best predicted batch sizes with the full pipeline."""
    warmup: int = 2
    """Untimed steps before each whole-step measurement."""
    choices: Literal["all", "mc"] = "all"
    """What the planner may choose: all (M/C per reversible block, keep or recompute per other layer, on CUDA also offload) or mc (Jiang et al.'s M/C per reversible block only)."""
    seed: int = 0
    """Seed of the model's weights and of the example batch."""
    verify: bool = True
    """Check first that every block rebuilds its input."""
    check_every: int | None = None
    """Check M-mode rebuilds on one step in this many while measuring (0: never; default: as the model's layers were built): plan with what training will use (revtrain train --check-every)."""
    threads: int | None = None
    """CPU threads for torch (default: torch's); 1 gives steadier timings on a shared machine."""

    def __post_init__(self) -> None:
        from revtrain.models import model_info

        if ":" in self.model:
            raise PlanConfigError(
                f"--model {self.model}: revtrain plan profiles registered models (`revtrain models`); plan your "
                "own model in the run that trains it (revtrain train --model module:factory --budget 6GiB), or in "
                "Python with revtrain.planner.plan_for_model(model, batch, budget)"
            )
        spec = model_info(self.model).inputs  # an unknown model fails here, with close matches
        for name, low in (("batch_size", 1), ("confirm", 0), ("warmup", 1)):
            _at_least(self, name, low)
        try:
            self.check_profile_options()
            check_budget(self.budget)
            float_dtype(self.dtype)
            resolve_device(self.device)
            if self.sweep is not None:
                parse_batch_sizes(self.sweep)
        except ValueError as err:
            raise PlanConfigError(str(err)) from None
        if self.input_shape is not None:
            self.input_shape = tuple(self.input_shape)
            example = "a sequence length like 512" if spec.kind == "tokens" else "sizes like 3 32 32"
            if not self.input_shape or min(self.input_shape) < 1:
                raise PlanConfigError(f"input_shape must be {example}, got {self.input_shape}")
            if len(self.input_shape) != len(spec.shape):
                raise PlanConfigError(
                    f"input_shape for {self.model}, a model of {spec.kind.removesuffix('s')} inputs of shape "
                    f"{' '.join(map(str, spec.shape))}, must be {len(spec.shape)} number(s): {example}; "
                    f"got {' '.join(map(str, self.input_shape))}"
                )
        if self.num_classes is not None:
            _at_least(self, "num_classes", 1)
        if self.threads is not None:
            _at_least(self, "threads", 1)
        if self.check_every is not None:
            _at_least(self, "check_every", 0)


def run_plan(config: PlanConfig, *, out: TextIO | None = None) -> int:
    """Run ``revtrain plan``; returns the exit code (errors are raised for the CLI to print)."""
    from revtrain.models import create_model_for, input_spec
    from revtrain.tasks import task_for

    out = out or sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    for flag, path in (("--out", config.out), ("--profile-out", config.profile_out)):
        if path:
            _refuse_existing(flag, Path(path), config.overwrite)
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)  # an unwritable place fails now
            except OSError as err:
                raise PlanConfigError(f"{flag} {path}: cannot make its folder ({err.strerror}); nothing was "
                                      "measured. Give a path in a folder you can write to") from None
    plots_dir = Path(config.plots_dir) if config.plots_dir else Path(config.out or ".").parent
    if config.sweep:
        for name in SWEEP_FILES:  # --plots-dir, or --out's folder
            _refuse_existing("--plots-dir" if config.plots_dir else "--sweep", plots_dir / name, config.overwrite)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    dev, dtype = resolve_device(config.device), float_dtype(config.dtype)
    spec = input_spec(config.model, input_size=config.input_shape, num_classes=config.num_classes)
    if spec.kind == "image":
        spec = spec.with_changes(dtype=dtype)
    torch.manual_seed(config.seed)
    # Built for the spec: an image model for its channels and classes, a token model for its
    # vocabulary and with the sequence length as its context.
    model = create_model_for(config.model, spec).to(dtype)
    if config.check_every is not None:  # the check's cost is part of every M-mode profile
        set_rebuild_checks(model, config.check_every)
    batch = spec.example(config.batch_size, dev, seed=config.seed)
    shape = f"{spec.shape[0]} tokens" if spec.kind == "tokens" else "x".join(map(str, spec.shape))
    say(f"revtrain plan: {config.model}, batch {config.batch_size} x {shape}, {config.dtype} on {dev}")
    with prepare(
        model, batch, loss_fn=task_for(spec).loss, device=dev, repeats=config.repeats,
        max_repeats=config.max_repeats, warmup=config.warmup, model_name=config.model,
    ) as setup:
        result = run_pipeline(
            setup, config.budget, verify=config.verify, refine=config.refine, baselines=True,
            timing=config.timing_rule(), progress=say, choices=config.choices,
        )
        if config.profile_out:
            result.profile.to_json(config.profile_out)
        report_plan(result, out)
        if config.out:
            result.plan.to_json(config.out)
            say(f"wrote {config.out}")
        if config.sweep:
            sizes = parse_batch_sizes(config.sweep)
            say(f"sweeping batch sizes {sizes} with the same pipeline ...")
            sweep = sweep_setup(
                setup, lambda b: spec.example(b, dev, seed=config.seed), sizes, result.plan.budget_bytes,
                confirm=config.confirm, verify=False, refine=config.refine, timing=config.timing_rule(),
                known={config.batch_size: result.profile}, progress=say, choices=config.choices,
            )
            sweep.budget_source = result.plan.budget_source
            report_sweep(sweep, out)
            from revtrain.planner.plots import write_sweep_plots

            paths = [*write_sweep_plots(sweep, plots_dir), plots_dir / SWEEP_FILES[-1]]
            sweep.to_json(paths[-1])
            for p in paths:
                say(f"wrote {p}")
    return 0


SWEEP_FILES = ("plan_heatmap.png", "plan_step_times.png", "plan_sweep.json")
"""What ``--sweep`` writes into ``--plots-dir`` (the PNGs are named by ``revtrain.planner.plots``)."""


def _refuse_existing(flag: str, path: Path, overwrite: bool) -> None:
    """A plan or profile can take minutes to measure: never replace one unasked."""
    if path.is_dir():
        raise PlanConfigError(f"{flag} {path} is a folder; give a file path such as {path / 'plan.json'}")
    if path.exists() and not overwrite:
        raise PlanConfigError(f"{flag} {path} exists already; nothing was measured. Pass --overwrite to replace "
                              f"it, or give {flag} another path")


def _at_least(config: PlanConfig, name: str, low: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PlanConfigError(f"{name} must be an integer >= {low}, got {value!r}")
