"""Errors of stage-parallel and data-parallel training.

Every one names the problem and the fix. Bad settings raise :class:`PipelineConfigError`
before any training starts; a worker that dies or stops answering ends the run with
:class:`StageFailedError`, which names the stage and the cause.
"""

from __future__ import annotations

from revtrain.errors import RevtrainError

__all__ = ["PipelineConfigError", "StageFailedError"]


class PipelineConfigError(RevtrainError, ValueError):
    """A stage split, a PETRA option or a launch setting that cannot work."""


class StageFailedError(RevtrainError, RuntimeError):
    """A stage's worker died, timed out or raised; the whole run was stopped."""
