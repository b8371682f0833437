"""When a run has diverged, and the error that stops it.

A run has diverged when a training step's loss is NaN or infinite, or when it exceeds
``divergence_factor`` times the run's *reference loss*: the loss of its very first step (kept in
the checkpoint, so a resumed run keeps the same bound). At initialisation a classifier's loss is
about ln(classes) and a language model's about ln(vocabulary); a healthy run stays below that,
so ten times it (the default) only trips when the optimisation has blown up. The check runs
before the optimizer step, so the diverged batch never reaches the weights.

Weights can also turn non-finite with a finite loss (NaN gradients from a bad backward); the
trainer checks the weights before every checkpoint, so a diverged state never replaces a good
checkpoint.
"""

from __future__ import annotations

import math

from revtrain.errors import RevtrainError

__all__ = ["TrainingDivergedError", "divergence_reason"]


class TrainingDivergedError(RevtrainError):
    """Training stopped because the loss or the weights went non-finite or past the bound."""


def divergence_reason(loss: float, reference: float | None, factor: float) -> str | None:
    """Why a step with this ``loss`` counts as diverged, or None when it does not.

    Args:
        loss: The step's training loss.
        reference: The run's first loss (None before the first step).
        factor: ``TrainConfig.divergence_factor``; 0 turns the bound off (non-finite still counts).
    """
    if not math.isfinite(loss):
        return f"the training loss is {loss}"
    if factor and reference is not None and reference > 0 and loss > factor * reference:
        return (f"the training loss {loss:.4g} is more than {factor:g} times the run's first loss "
                f"{reference:.4g} (--divergence-factor)")
    return None
