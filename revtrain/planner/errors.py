"""What the planner refuses: a budget no plan can meet, a plan made for another model."""

from __future__ import annotations

from revtrain.errors import RevtrainError

__all__ = ["BudgetTooSmallError", "PlanMismatchError"]


class BudgetTooSmallError(RevtrainError, ValueError):
    """The memory budget is below what even all-M-mode needs: no plan can meet it."""

    def __init__(
        self,
        message: str,
        *,
        budget_bytes: int,
        required_bytes: int,
        batch_size: int,
        max_batch_size: int | None,
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        """The budget that was asked for."""
        self.required_bytes = required_bytes
        """The smallest budget known to be needed at this batch size: the baseline-M peak once
        profiled, before that a lower bound (parameters, gradients, buffers and the batch)."""
        self.batch_size = batch_size
        """The batch size planned for."""
        self.max_batch_size = max_batch_size
        """Estimated largest batch size whose baseline-M peak fits the budget (0: none does);
        None when not known (the budget was refused before profiling)."""


class PlanMismatchError(RevtrainError, ValueError):
    """A plan names blocks that the model does not have, or misses some it has."""
