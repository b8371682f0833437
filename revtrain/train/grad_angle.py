"""The gradient angle monitor (RevNet §5.2, its Fig. 4): stored against rebuilt activations.

On one batch, :func:`gradient_angles` computes the gradient twice: with every reversible layer
in C-mode (activations stored: plain autograd) and in M-mode (activations rebuilt from the
outputs, with whatever rounding drift the rebuild has). Per parameter group it reports the
angle between the two gradients and the relative error ``‖g_M - g_C‖ / ‖g_C‖``. The model's
state is left exactly as it was: modes, buffers (batch-norm statistics), ``.grad`` and the
random generators (both passes draw the same dropout masks, and training continues with the
numbers it would have drawn without the monitor).

:func:`plot_grad_angles` draws a series of such measurements over training to a PNG.

Example:
    >>> result = gradient_angles(model, (x, y), torch.nn.functional.cross_entropy)
    >>> result.overall.angle_deg, result.to_record()
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.core import get_modes, reversible_blocks, set_modes

__all__ = [
    "GroupAngle",
    "GradAngleResult",
    "GradAngleMonitor",
    "gradient_angles",
    "angle_between",
    "plot_grad_angles",
]

ALL = "all"
"""The group of every parameter together."""


@dataclass(frozen=True)
class GroupAngle:
    """Stored- against rebuilt-activation gradients of one parameter group."""

    group: str
    """Module-name prefix of the group's parameters (``"all"``: every parameter)."""
    angle_deg: float
    """Angle between the two gradients, in degrees (0: same direction)."""
    rel_error: float
    """``‖g_M - g_C‖ / ‖g_C‖``."""
    norm_stored: float
    """``‖g_C‖``, the gradient with stored activations."""
    parameters: int
    """Number of parameter tensors in the group."""


@dataclass(frozen=True)
class GradAngleResult:
    """One measurement: per group, and over all parameters."""

    groups: tuple[GroupAngle, ...]
    """One entry per group, ``"all"`` first."""

    @property
    def overall(self) -> GroupAngle:
        return self.groups[0]

    def to_record(self) -> dict[str, Any]:
        """Plain data for a metrics file: ``{"groups": {name: {"angle_deg": ..., ...}}}``."""
        return {"groups": {g.group: {k: v for k, v in asdict(g).items() if k != "group"} for g in self.groups}}


def angle_between(a: Tensor, b: Tensor) -> float:
    """Angle between two vectors in degrees, accurate for tiny angles too.

    ``2·atan2(‖â − b̂‖, ‖â + b̂‖)`` keeps full precision where ``acos`` of a cosine near 1
    cannot (it resolves nothing below ~1e-6 degrees in float64).
    """
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return 0.0 if na == nb else 90.0
    ua, ub = a / na, b / nb
    return math.degrees(2 * math.atan2(float((ua - ub).norm()), float((ua + ub).norm())))


def gradient_angles(
    model: nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    group_depth: int = 1,
    groups: Callable[[str], str] | None = None,
) -> GradAngleResult:
    """Compare the gradients of one batch with stored (C-mode) and rebuilt (M-mode) activations.

    Args:
        model: Any model with reversible layers (``revtrain.reversible_blocks``); its modes,
            buffers, ``.grad`` and the random generators are restored afterwards.
        batch: ``(inputs, targets)``; ``inputs`` is passed to ``model`` (a tuple is unpacked).
        loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar (e.g. ``task.loss``).
        group_depth: Group parameters by the first ``group_depth`` components of their name
            (``"stages.0.weight"`` -> ``"stages"`` at depth 1, ``"stages.0"`` at depth 2).
        groups: A function from parameter name to group name, instead of ``group_depth``.

    Returns:
        The angle and relative error per group, ``"all"`` first.
    """
    if not reversible_blocks(model):
        raise ValueError(
            f"{type(model).__name__} has no reversible layer, so stored and rebuilt activations "
            "are the same: there is no angle to measure"
        )
    if group_depth < 1:
        raise ValueError(f"group_depth must be at least 1, got {group_depth}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    group_of = groups or (lambda name: ".".join(name.split(".")[:group_depth]))
    state = _ModelState.capture(model)
    try:
        stored = _gradients(model, "C", batch, loss_fn, named, state)
        rebuilt = _gradients(model, "M", batch, loss_fn, named, state)
    finally:
        state.restore(model)
    by_group: dict[str, list[int]] = {}
    for k, (name, _) in enumerate(named):
        by_group.setdefault(group_of(name), []).append(k)
    results = [_compare(ALL, list(range(len(named))), stored, rebuilt)]
    results += [_compare(g, idx, stored, rebuilt) for g, idx in by_group.items()]
    return GradAngleResult(tuple(results))


def _compare(group: str, idx: list[int], stored: list[Tensor], rebuilt: list[Tensor]) -> GroupAngle:
    a = torch.cat([stored[k].flatten().double() for k in idx])
    b = torch.cat([rebuilt[k].flatten().double() for k in idx])
    norm = float(a.norm())
    rel = float((b - a).norm()) / norm if norm > 0 else float((b - a).norm())
    return GroupAngle(group, angle_between(a, b), rel, norm, len(idx))


def _gradients(
    model: nn.Module,
    mode: str,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], Tensor],
    named: list[tuple[str, Tensor]],
    state: _ModelState,
) -> list[Tensor]:
    state.restore(model)  # same buffers, same random numbers, for both passes
    set_modes(model, mode)
    inputs, targets = batch
    out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    loss = loss_fn(out, targets)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for g, (_, p) in zip(grads, named)]


@dataclass
class _ModelState:
    """What a measurement must leave as it found: modes, buffers, random generators."""

    modes: dict[str, str]
    buffers: dict[str, Tensor]
    cpu_rng: Tensor
    cuda_rng: list[Tensor] | None

    @classmethod
    def capture(cls, model: nn.Module) -> _ModelState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(
            modes=dict(get_modes(model)),
            buffers={name: b.detach().clone() for name, b in model.named_buffers()},
            cpu_rng=torch.get_rng_state(),
            cuda_rng=cuda,
        )

    def restore(self, model: nn.Module) -> None:
        set_modes(model, self.modes)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in self.buffers:
                    b.copy_(self.buffers[name])
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


# -- plotting ----------------------------------------------------------------------------------


def _records(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    if isinstance(source, (str, os.PathLike)):
        lines = Path(source).read_text(encoding="utf-8").splitlines()
        rows: Iterable[Mapping[str, Any]] = [json.loads(line) for line in lines if line.strip()]
    else:
        rows = source
    return [r for r in rows if r.get("event", event) == event and "groups" in r]


def plot_grad_angles(
    source: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str = "Stored vs rebuilt activations (RevNet §5.2)",
    event: str = "grad_angle",
    x_key: str = "step",
) -> Path:
    """Plot angle and relative error per group over training to a PNG.

    Args:
        source: A ``metrics.jsonl`` file, or records, each with ``x_key`` and the ``"groups"``
            of :meth:`GradAngleResult.to_record` (records of other events are skipped).
        path: The PNG to write (its folder is created).
        title: Figure title.
        event: The ``"event"`` of the records to plot (records without one are kept).
        x_key: The field for the x axis.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _records(source, event)
    if not rows:
        raise ValueError(f"no {event!r} records with 'groups' to plot in {source!s:.200}")
    names = list(rows[0]["groups"])
    fig, (ax_angle, ax_err) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        xs = [r[x_key] for r in rows if name in r["groups"]]
        angles = [r["groups"][name]["angle_deg"] for r in rows if name in r["groups"]]
        errors = [r["groups"][name]["rel_error"] for r in rows if name in r["groups"]]
        style = {"linewidth": 2.2, "color": "black"} if name == ALL else {"linewidth": 1.0}
        ax_angle.plot(xs, angles, label=name, **style)
        ax_err.plot(xs, errors, label=name, **style)
    ax_angle.set_ylabel("angle (degrees)")
    ax_err.set_ylabel("‖g_M − g_C‖ / ‖g_C‖")
    # Both span many decades (0 with exact couplings, ~1e-5 degrees typically, spikes far above).
    ax_angle.set_yscale("symlog", linthresh=1e-6)
    ax_err.set_yscale("symlog", linthresh=1e-8)
    for ax in (ax_angle, ax_err):
        ax.set_xlabel(x_key)
        ax.grid(True, alpha=0.3)
    ax_angle.legend(fontsize=7, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# -- in the trainer ----------------------------------------------------------------------------


class GradAngleMonitor:
    """``revtrain train --grad-angle-every N``: a measurement every ``N`` steps, on that step's batch.

    Before every ``every``-th update (:meth:`due`) the trainer calls :meth:`measure`, which
    measures :func:`gradient_angles` with the parameters the update is about to use; the trainer
    writes the result as a ``"grad_angle"`` record to the metrics file. The measurement leaves the model, its
    gradients and the random generators as they were, so a run with the monitor trains exactly
    like one without. :meth:`plot` draws every record of the run folder's metrics file (resumed
    runs included).
    """

    PNG = "grad_angles.png"

    def __init__(
        self,
        every: int,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], Tensor],
        *,
        context: Callable[[], Any],
        group_depth: int = 1,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if not reversible_blocks(model):
            raise ValueError(
                f"--grad-angle-every compares stored with rebuilt activations, but {type(model).__name__} "
                "has no reversible layer: use a reversible model (revtrain models) or drop the option"
            )
        self.every, self.model, self.loss_fn = every, model, loss_fn
        self.context, self.group_depth = context, group_depth
        self.results: list[GradAngleResult] = []
        """What this process measured, in order."""

    def due(self, step: int) -> bool:
        """Whether the update that makes ``step`` (1-based) is measured."""
        return step % self.every == 0

    def measure(self, batch: tuple[Any, Any]) -> GradAngleResult:
        """Measure on ``batch`` (the batch of a due update, before it) and keep the result."""
        with self.context():
            result = gradient_angles(self.model, batch, self.loss_fn, group_depth=self.group_depth)
        self.results.append(result)
        return result

    def summary_line(self) -> str | None:
        """One line for the end of a run: how many measurements, the largest angle and error."""
        if not self.results:
            return None
        worst = max(self.results, key=lambda r: r.overall.angle_deg).overall
        largest_error = max(r.overall.rel_error for r in self.results)
        return (
            f"gradient angle, stored vs rebuilt activations ({len(self.results)} measurements in this "
            f"process): at most {worst.angle_deg:.3g} degrees, relative error at most {largest_error:.2g}"
        )

    def plot(self, metrics_path: Path, run_dir: Path) -> Path | None:
        """Draw the run's records to ``run_dir/grad_angles.png``; None when there are none."""
        records = _records(metrics_path, "grad_angle") if metrics_path.exists() else []
        return plot_grad_angles(records, run_dir / self.PNG) if records else None
