"""Stage 1 of the planner: every reversible block must rebuild its input from its output.

The check itself is the core's (:func:`revtrain.core.verify_invertible`, docs/core.md); the
planner runs it on the prepared example batch, in the model's own train/eval mode, before
measuring anything, so that a block that does not invert is named before it is timed.
"""

from __future__ import annotations

from revtrain.core import VerificationReport, verify_invertible
from revtrain.planner.setup import MeasurementSetup

__all__ = ["verify_setup"]


def verify_setup(setup: MeasurementSetup) -> VerificationReport:
    """Check every block of ``setup``'s model on its batch.

    Raises:
        NotInvertibleError: some block does not rebuild its input; the message names it.
    """
    return verify_invertible(setup.model, setup.inputs)
