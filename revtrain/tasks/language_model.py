"""Language modelling: next-token cross-entropy, reported as bits per byte.

For a byte-level model (vocabulary 256, one token per byte) the mean cross-entropy in nats
divided by ln 2 is the number of bits per byte (bpb) an arithmetic coder driven by the model
would need, the figure enwik8 results are quoted in. The baseline to beat is the unigram
entropy of the bytes (:func:`unigram_entropy`): what a model that ignores all context gets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from revtrain.tasks.base import Task

__all__ = ["LanguageModeling", "unigram_cross_entropy", "unigram_entropy"]


def _check(output: Tensor, target: Tensor) -> None:
    if output.dim() != target.dim() + 1 or output.shape[:-1] != target.shape:
        raise ValueError(
            f"language modelling needs logits (batch, sequence, vocab) and targets (batch, sequence); "
            f"got logits {tuple(output.shape)} and targets {tuple(target.shape)}"
        )


class LanguageModeling(Task):
    """Logits ``(B, T, V)`` against next ids ``(B, T)``: mean cross-entropy per token, bits per byte."""

    name = "language_modeling"
    input_kind = "tokens"
    headline = "bpb"
    higher_is_better = False

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        _check(output, target)
        return F.cross_entropy(output.flatten(0, -2), target.flatten())

    @torch.no_grad()
    def batch_sums(self, output: Tensor, target: Tensor, loss: Tensor | None = None) -> dict[str, float]:
        _check(output, target)
        tokens = target.numel()
        mean = loss.detach() if loss is not None else F.cross_entropy(output.flatten(0, -2).float(), target.flatten())
        correct = (output.argmax(-1) == target).sum()
        return {"loss_sum": float(mean) * tokens, "correct": float(correct), "count": float(tokens)}

    def summarize(self, sums: Mapping[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 0.0), 1.0)
        loss = sums.get("loss_sum", 0.0) / count
        return {"loss": loss, "bpb": loss / math.log(2), "acc": sums.get("correct", 0.0) / count}

    def format(self, metrics: Mapping[str, float]) -> str:
        return f"loss {metrics['loss']:.4f} bpb {metrics['bpb']:.3f} acc {metrics['acc']:6.2%}"


def _counts(data: Tensor | bytes, vocab_size: int) -> Tensor:
    if isinstance(data, bytes | bytearray):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    ids = data
    if ids.numel() == 0:
        raise ValueError("the unigram entropy of an empty corpus is undefined; pass some bytes")
    return torch.bincount(ids.flatten().to(torch.int64), minlength=vocab_size).double()


def unigram_entropy(data: Tensor | bytes, vocab_size: int = 256) -> float:
    """Entropy, in bits per token, of the token frequencies of ``data`` (bytes or ids).

    The loss a model reaches by predicting every token from the corpus-wide frequencies alone.
    """
    p = _counts(data, vocab_size)
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum())


def unigram_cross_entropy(data: Tensor | bytes, fit: Tensor | bytes, vocab_size: int = 256) -> float:
    """Bits per token of ``data`` under the frequencies of ``fit`` (add-one smoothed).

    The fair baseline for a validation loss: the unigram model fitted on the training split
    and scored on the validation split, as the language model is.
    """
    q = _counts(fit, vocab_size) + 1.0
    q = q / q.sum()
    counts = _counts(data, vocab_size)
    return float(-(counts * q.log2()).sum() / counts.sum())
