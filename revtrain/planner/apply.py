"""Stage 4 of the planner: set each reversible block to its planned mode (Jiang et al. 2021, §3.3)
and each plain layer to its planned option (keep, recompute, offload: :mod:`revtrain.planner.recompute`).

Nothing else about training changes: the model trains as usual afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from revtrain.core import reversible_blocks, set_modes
from revtrain.planner.errors import PlanMismatchError
from revtrain.planner.recompute import plain_layers, set_layer_options

__all__ = ["PlanChoices", "apply_plan"]


class PlanChoices(Protocol):
    """What applying a plan reads of it (``revtrain.planner.data.Plan`` has it)."""

    @property
    def modes(self) -> Mapping[str, str]: ...  # reversible block name -> "M" or "C"

    @property
    def layers(self) -> Mapping[str, str]: ...  # plain layer name -> "keep", "recompute", "offload"

    @property
    def model(self) -> str: ...  # the model it was made for ("" if not known)

    @property
    def batch_size(self) -> int | None: ...


def apply_plan(plan: PlanChoices, model: Any) -> Any:
    """Set every reversible block of ``model`` to ``plan``'s mode for it, and every plain layer to
    its option (layers the plan does not name keep); returns ``model``.

    Raises:
        PlanMismatchError: the plan's block names differ from the model's reversible blocks, or it
            names plain layers the model does not have (nothing is changed then).
    """
    names = [name for name, _ in reversible_blocks(model)]
    in_model = set(names)
    missing = [name for name in plan.modes if name not in in_model]
    extra = [name for name in names if name not in plan.modes]
    plain = [name for name, _ in plain_layers(model)]
    unknown_layers = [name for name in plan.layers if name not in set(plain)]
    if missing or extra or unknown_layers:
        parts = []
        if missing:
            parts.append(f"{len(missing)} block(s) in the plan are not in the model: {_few(missing)}")
        if extra:
            parts.append(f"{len(extra)} reversible block(s) of the model are not in the plan: {_few(extra)}")
        if unknown_layers:
            parts.append(f"{len(unknown_layers)} plain layer(s) in the plan are not in the model: {_few(unknown_layers)}")
        origin = ""
        if plan.model:
            at = f" at batch size {plan.batch_size}" if plan.batch_size else ""
            origin = f" (it was made for {plan.model!r}{at})"
        raise PlanMismatchError(
            "plan does not match the model: " + "; ".join(parts) + ". The plan was probably "
            f"made for another model{origin}; profile and plan this model again"
            + (f", or train the model it was made for (--model {plan.model})." if plan.model else ".")
        )
    set_modes(model, dict(plan.modes))
    set_layer_options(model, {name: plan.layers.get(name, "keep") for name in plain})
    return model


def _few(names: list[str], k: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return f"[{shown}{', ...' if len(names) > k else ''}]"
