"""Exceptions and warnings raised by revtrain.

Every error names the problem and the fix. They subclass the built-in exception a
caller would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for
failures during a run), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "RevtrainError",
    "ReversibilityError",
    "NotInvertibleError",
    "ReconstructionError",
    "GridOverflowError",
    "ReconstructionDriftWarning",
    "unknown_names_error",
]


class RevtrainError(Exception):
    """Base class of every exception raised by revtrain."""


class ReversibilityError(RevtrainError, ValueError):
    """A reversible block was built or called in a way that cannot be inverted exactly."""


class NotInvertibleError(ReversibilityError):
    """``verify_invertible`` found blocks whose inverse does not rebuild their input."""


class ReconstructionError(RevtrainError, RuntimeError):
    """Rebuilding a block's input during backward failed (non-finite values, drift, in-place edits)."""


class GridOverflowError(ReconstructionError):
    """An activation left the fixed-point grid's range (or was not finite), so an exact
    coupling could no longer rebuild its input bit for bit."""


class ReconstructionDriftWarning(UserWarning):
    """The rebuilt input of a block drifted from the original by more than the block's tolerance."""


def unknown_names_error(unknown: list[str], known: list[str], item: str, kind: str) -> ValueError:
    """The error for names that a plan or a mapping gives and the model lacks (block modes,
    plain-layer options): the first few unknown names, how the model's ``kind`` are named, and the
    likely cause. ``item`` names one of them (``"block"``), ``kind`` all of them
    (``"reversible blocks"``)."""
    shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
    named = ", ".join(known[:3]) + (" ..." if len(known) > 3 else "")
    return ValueError(
        f"{len(unknown)} {item} name(s) not in this model: {shown}. The model's {kind} are named like: "
        f"{named or '(none)'}. Was the plan made for another model?"
    )
