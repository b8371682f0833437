"""Stage 1 of the planner: check numerically that every reversible block inverts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.core.arguments import ExtraArgs
from revtrain.core.invertible import Invertible
from revtrain.core.modes import reversible_blocks
from revtrain.core.replay import RngState, no_running_stat_updates
from revtrain.errors import NotInvertibleError

__all__ = ["verify_invertible", "BlockCheck", "VerificationReport", "default_tolerance"]


def default_tolerance(dtype: torch.dtype) -> float:
    """Relative rebuild error accepted per block: a few hundred ulps of the dtype."""
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 2e-2)


@dataclass(frozen=True)
class BlockCheck:
    """Rebuild error of one block: ``max|x - x_rebuilt| / max|x|``."""

    name: str
    max_abs_error: float
    rel_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.tolerance


@dataclass
class VerificationReport:
    """The result of :func:`verify_invertible`, one :class:`BlockCheck` per block called."""

    checks: list[BlockCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[BlockCheck]:
        return [c for c in self.checks if not c.ok]

    def table(self) -> str:
        rows = [f"{'block':40s} {'max abs err':>12s} {'rel err':>10s} {'tol':>8s}  ok"]
        for c in self.checks:
            rows.append(
                f"{c.name[:40]:40s} {c.max_abs_error:12.3e} {c.rel_error:10.3e} "
                f"{c.tolerance:8.1e}  {'yes' if c.ok else 'NO'}"
            )
        return "\n".join(rows)


def verify_invertible(
    module: nn.Module,
    example_input: Any,
    *,
    rtol: float | None = None,
    raise_on_failure: bool = True,
) -> VerificationReport:
    """Run ``module(example_input)`` once and check that each reversible block rebuilds its input.

    Each block's input is rebuilt from its output as backward would (same generators, same
    mode) and compared with the real input; buffers and generators are left as they were.

    Args:
        module: Any model containing ``ReversibleBlock`` modules.
        example_input: A tensor (or tuple of positional arguments) the model accepts.
        rtol: Relative error accepted per block; default from the input dtype
            (:func:`default_tolerance`).
        raise_on_failure: Raise :class:`~revtrain.errors.NotInvertibleError` listing failing
            blocks; otherwise only return the report.

    Raises:
        ValueError: the module has no reversible block.
        NotInvertibleError: some block does not rebuild its input within ``rtol``.
    """
    names = {id(block): name for name, block in reversible_blocks(module)}
    if not names:
        raise ValueError(
            f"{type(module).__name__} contains no reversible layer (ReversibleBlock or other "
            "Invertible); nothing to verify"
        )
    report = VerificationReport()
    pending: dict[int, tuple[RngState, tuple[Tensor, ...]]] = {}

    def before(layer: Invertible, args: tuple, kwargs: dict) -> None:
        xs = layer.to_state(args[0])
        coupling = getattr(layer, "coupling", None)
        if coupling is not None:  # what the block really maps (an exact coupling quantises)
            xs, _ = coupling.prepare_input(tuple(xs), None)
        extra = ExtraArgs.of(args[1:], kwargs)
        pending[id(layer)] = (RngState.capture(xs[0].device), tuple(x.detach().clone() for x in xs), extra)

    def after(layer: Invertible, args: tuple, kwargs: dict, output: Any) -> None:
        rng, xs, extra = pending.pop(id(layer))
        ys = tuple(y.detach() for y in layer.to_state(output))
        # Rebuild exactly as backward does: the forward's record (its generator states) comes
        # from running the layer's step once more with the generators it started from; then
        # the layer's own reverse step rebuilds the input (no gradient asked for).
        with rng.replay(), no_running_stat_updates(layer):
            _, record = layer.step_forward(xs, extra)
        with no_running_stat_updates(layer):
            result = layer.step_reverse(ys, (None,) * len(ys), record, layer.step_params(), False, extra)
        err, scale = 0.0, 0.0
        for real, rebuilt in zip(xs, result.inputs):
            diff = (real.double() - rebuilt.double()).abs()
            worst = float(diff.max()) if diff.numel() else 0.0
            err = worst if worst != worst else max(err, worst)  # a NaN stays (max would drop it)
            scale = max(scale, float(real.double().abs().max()) if real.numel() else 0.0)
        rel = err / scale if scale > 0 else err
        if rel != rel:  # NaN: a non-finite rebuild is a failure, whatever the tolerance
            rel = float("inf")
        tol = rtol if rtol is not None else default_tolerance(xs[0].dtype)
        report.checks.append(BlockCheck(names[id(layer)], err, rel, tol))

    state = {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, Tensor)}
    cpu_rng = torch.get_rng_state()
    handles = []
    for _, block in reversible_blocks(module):
        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.no_grad():
            args = example_input if isinstance(example_input, tuple) else (example_input,)
            module(*args)
    finally:
        for h in handles:
            h.remove()
        module.load_state_dict(state, strict=False)
        torch.set_rng_state(cpu_rng)
    if raise_on_failure and not report.ok:
        raise NotInvertibleError(
            f"{len(report.failures)} of {len(report.checks)} reversible blocks do not rebuild "
            f"their input:\n{report.table()}\nA block is invertible only if F and G are "
            "deterministic functions (or draw random numbers from torch's generators), do not "
            "modify their input in place, and the coupling's inverse matches its forward. Fix "
            "the block or run it in C-mode, where no rebuild happens."
        )
    return report
