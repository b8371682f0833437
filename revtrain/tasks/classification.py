"""Image classification: cross-entropy loss, top-1 accuracy."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from revtrain.tasks.base import Task

__all__ = ["Classification"]


class Classification(Task):
    """Logits ``(B, K)`` against class ids ``(B,)``: mean cross-entropy, accuracy."""

    name = "classification"
    input_kind = "image"
    headline = "acc"
    higher_is_better = True

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    @torch.no_grad()
    def batch_sums(self, output: Tensor, target: Tensor, loss: Tensor | None = None) -> dict[str, float]:
        n = int(target.shape[0])
        if loss is not None:
            loss_sum = float(loss.detach()) * n
        else:  # summed in float32 by torch, as evaluation always did: exact, not mean * n
            loss_sum = float(F.cross_entropy(output.float(), target, reduction="sum"))
        correct = (output.argmax(1) == target).sum()
        return {"loss_sum": loss_sum, "correct": float(correct), "count": float(n)}

    def summarize(self, sums: Mapping[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 0.0), 1.0)
        return {"loss": sums.get("loss_sum", 0.0) / count, "acc": sums.get("correct", 0.0) / count}

    def format(self, metrics: Mapping[str, float]) -> str:
        return f"loss {metrics['loss']:.4f} acc {metrics['acc']:6.2%}"
