"""A model as a chain of units: the places where PETRA may cut it into stages.

Stage-parallel training cuts a network at block boundaries. :func:`model_units` lists the
units of a model in the order its forward applies them:

- a zoo model (``stem``, ``stages``, ``head``, with ``forward = head(stages(stem(x)))``):
  the stem, then every unit of every group — each reversible block of a
  :class:`~revtrain.core.ReversibleSequence` on its own, each downsampling or residual unit —
  then the head;
- an ``nn.Sequential`` (or a ``ReversibleSequence``): its children, with nested plain
  ``nn.Sequential`` containers and ``ReversibleSequence`` s opened up the same way.

A unit is *reversible* when it is an :class:`~revtrain.core.Invertible` (a coupling block or
any invertible layer): PETRA can rebuild its input from its output instead of keeping it.
The *blocks* are the units other than the stem and the head; every stage holds at least one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from revtrain.core import Invertible, ReversibleSequence
from revtrain.parallel.errors import PipelineConfigError

__all__ = ["Unit", "UnitRole", "model_units"]

UnitRole = Literal["stem", "block", "head"]


@dataclass(frozen=True, eq=False)
class Unit:
    """One link of the chain a model's forward applies."""

    name: str
    """Module name in the model (``named_modules``), e.g. ``"stages.1.reversible.blocks.0"``."""
    module: nn.Module
    """The module itself (shared with the model: no copy)."""
    role: UnitRole
    """``"stem"`` (goes with the first stage), ``"head"`` (with the last) or ``"block"``."""

    @property
    def reversible(self) -> bool:
        """Whether the unit's input can be rebuilt from its output (an ``Invertible``)."""
        return isinstance(self.module, Invertible)


def model_units(model: nn.Module) -> list[Unit]:
    """The units of ``model`` in forward order (module docstring).

    Raises:
        PipelineConfigError: the model is neither a stem/stages/head model nor a sequence, so
            there is no known order in which its forward applies its parts.
    """
    if all(hasattr(model, a) for a in ("stem", "stages", "head")):
        units = [Unit("stem", model.stem, "stem")]
        units += _opened(model.stages, "stages")
        units.append(Unit("head", model.head, "head"))
        return units
    if type(model) is nn.Sequential or isinstance(model, ReversibleSequence):
        units = _opened(model, "")
        if units:
            return units
    raise PipelineConfigError(
        f"cannot cut a {type(model).__name__} into stages: stage-parallel training needs a model "
        "whose forward is a chain of units, either a zoo model (stem, stages, head) or an "
        "nn.Sequential of layers and reversible blocks; rebuild the model as one of those"
    )


def _opened(container: nn.Module, prefix: str) -> list[Unit]:
    units: list[Unit] = []
    children = container.blocks if isinstance(container, ReversibleSequence) else container
    base = _join(prefix, "blocks") if isinstance(container, ReversibleSequence) else prefix
    for name, child in children.named_children():
        full = _join(base, name)
        if type(child) is nn.Sequential or isinstance(child, ReversibleSequence):
            units += _opened(child, full)
        else:
            units.append(Unit(full, child, "block"))
    return units


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
