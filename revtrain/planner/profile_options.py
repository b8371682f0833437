"""How carefully the planner measures: the options ``revtrain plan`` and ``revtrain train --budget``
share (both configs inherit :class:`ProfileOptions`, so each option has one name, one default,
one help text and one check)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from revtrain.planner.block_timing import TimingRule

__all__ = ["PROFILE_OPTIONS", "ProfileOptions"]


@dataclass(kw_only=True)
class ProfileOptions:
    """How carefully the planner profiles and measures. The defaults are quick (a small model is
    planned in well under a minute on two busy cores); on a quiet machine, more pairs and more
    refinement give a steadier plan."""

    repeats: int = 3
    """Planner: timed rounds of each whole-step measurement, at least (medians are used)."""
    max_repeats: int | None = None
    """Planner: timed rounds at most: more are timed while a median step is not yet known to 2% (default: 4 x --repeats)."""
    refine: int = 1
    """Planner: measure up to this many richer plans and keep the fastest that fits (0: the plan as solved)."""
    t_e_precision: float = 0.05
    """Planner: time each block's M/C pairs until the standard error of its median t_e is this fraction of it."""
    t_e_max_pairs: int = 5
    """Planner: at most this many M/C pairs per block, however noisy (more: a steadier plan, slower planning)."""

    def check_profile_options(self) -> None:
        """Raise ``ValueError`` naming the option whose value cannot work."""
        for name, low in (("repeats", 1), ("refine", 0), ("t_e_max_pairs", 1)):
            _at_least(name, getattr(self, name), low)
        if self.max_repeats is not None:
            _at_least("max_repeats", self.max_repeats, self.repeats)
        if isinstance(self.t_e_precision, bool) or not isinstance(self.t_e_precision, (int, float)) \
                or not 0 < self.t_e_precision < 1:
            raise ValueError(f"t_e_precision (--t-e-precision) must be a fraction between 0 and 1 such as 0.05, "
                             f"got {self.t_e_precision!r}")

    def timing_rule(self) -> TimingRule:
        """How each block's ``t_e`` is timed."""
        return TimingRule.with_cap(self.t_e_precision, self.t_e_max_pairs)

    def pipeline_options(self) -> dict[str, Any]:
        """These options as keyword arguments of :func:`~revtrain.planner.plan_for_model`."""
        return {"repeats": self.repeats, "max_repeats": self.max_repeats, "refine": self.refine,
                "timing": self.timing_rule()}


PROFILE_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(ProfileOptions))
"""The names of the shared options (``revtrain train`` shows them in a group of their own)."""


def _at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= {low}, got {value!r}")
