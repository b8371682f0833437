"""Reformer-style reversible decoder-only language models and their plain twins.

The reversible model (Kitaev et al. 2020, as planned by Jiang et al. 2021 §4.5) embeds the
tokens once, duplicates the embedding into two streams ``(x1, x2) = (h, h)`` and runs
``depth`` reversible blocks::

    y1 = x1 + Attention(LN(x2))        F: causal multi-head self-attention, pre-LN
    y2 = x2 + FeedForward(LN(y1))      G: position-wise feed-forward, pre-LN

Each block is an ordinary :class:`~revtrain.core.ReversibleBlock` on ``(B, T, D)`` halves,
all of them in one :class:`~revtrain.core.ReversibleSequence` (M-mode keeps one output for
the whole stack). The streams are merged by their mean ``(y1 + y2) / 2`` (as reformer-pytorch
does; a mean has no parameters, so the twin has exactly the same count), then a final
LayerNorm and a linear head give next-token logits ``(B, T, vocab)``.

The plain twin (:class:`TransformerLM`) has the same embedding, the same attention and
feed-forward modules and the same head, with ordinary pre-LN residuals
``x = x + Attention(LN(x)); x = x + FeedForward(LN(x))`` on one stream of width ``D``.

Models are plain PyTorch: memory modes are set from outside (:func:`revtrain.core.set_modes`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor, nn

from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.models.inputs import token_input
from revtrain.models.registry import register_model
from revtrain.models.transformer_layers import (
    FeedForward,
    SelfAttention,
    SequenceTooLongError,
    check_heads,
    init_transformer_weights,
    run_stack,
)

__all__ = ["LMHead", "ResidualLayer", "RevTransformerLM", "TokenEmbedding", "TransformerConfig", "TransformerLM"]


@dataclass(kw_only=True)
class TransformerConfig:
    """The shape and options of a decoder-only language model (both twins)."""

    vocab_size: int = 256
    """Token ids are below this (256: bytes)."""
    context: int = 128
    """Longest sequence the model accepts (and the length of the learned position table)."""
    width: int = 128
    """Features ``D`` of a stream. The reversible model carries two streams (``2D`` in all)."""
    depth: int = 4
    """Layers: one attention and one feed-forward each (one ``ReversibleBlock`` each)."""
    heads: int = 4
    """Attention heads; must divide ``width``."""
    ff_mult: int = 4
    """Hidden features of the feed-forward, as a multiple of ``width``."""
    dropout: float = 0.0
    """Dropout on the embedding, the attention probabilities and both residual branches."""
    positions: Literal["learned", "rotary"] = "learned"
    """``"learned"``: a table of ``context`` position vectors added to the embedding;
    ``"rotary"``: rotary embedding of queries and keys inside each attention (no parameters)."""
    tie_embeddings: bool = False
    """Share the output head's weight with the token embedding."""
    ff_chunks: int = 1
    """Apply each feed-forward to this many slices of the sequence in turn (1: no chunking)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "depth", "ff_mult", "ff_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}")
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"positions must be 'learned' or 'rotary', got {self.positions!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        check_heads(self.width, self.heads, rotary=self.positions == "rotary", owner="TransformerConfig")

    def layer(self, *, causal: bool = True) -> tuple[SelfAttention, FeedForward]:
        """One layer's two residual functions (attention, feed-forward), freshly initialised."""
        attn = SelfAttention(
            self.width, self.heads, causal=causal, dropout=self.dropout, rotary=self.positions == "rotary"
        )
        ff = FeedForward(self.width, self.ff_mult * self.width, dropout=self.dropout, chunks=self.ff_chunks)
        return attn, ff


class TokenEmbedding(nn.Module):
    """Token ids ``(B, T)`` to vectors ``(B, T, D)``: token table, learned positions, dropout.

    Refuses, before any work, ids that are not an integer ``(B, T)`` tensor, a ``T`` above the
    context, and ids outside the vocabulary (one host sync per forward).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.context = config.context
        self.tokens = nn.Embedding(config.vocab_size, config.width)
        learned = config.positions == "learned"
        self.positions = nn.Embedding(config.context, config.width) if learned else None
        self.drop = nn.Dropout(config.dropout)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(
                f"a language model takes integer token ids of shape (batch, sequence); got a "
                f"{ids.dtype} tensor of shape {tuple(ids.shape)}"
            )
        length = ids.shape[1]
        if length > self.context:
            raise SequenceTooLongError(
                f"a sequence of {length} tokens is longer than the model's context of "
                f"{self.context}; cut it to the last {self.context} tokens, or build the model with "
                f"context={length} (e.g. create_model(name, context={length}))"
            )
        if ids.device.type != "meta" and ids.numel() and (
            int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size
        ):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}); got ids from {int(ids.min())} to "
                f"{int(ids.max())}. Encode the text with this model's vocabulary (bytes: 0-255)"
            )
        h = self.tokens(ids)  # (B, T, D)
        if self.positions is not None:
            h = h + self.positions.weight[:length]
        return self.drop(h)


class LMHead(nn.Module):
    """Final LayerNorm and a bias-free linear map to next-token logits ``(B, T, vocab)``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.width)
        self.out = nn.Linear(config.width, config.vocab_size, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.norm(h))


class _LanguageModel(nn.Module):
    """Embedding and head shared by both twins; subclasses set ``layers``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config)

    def _finish(self) -> None:
        self.head = LMHead(self.config)
        init_transformer_weights(self, self.config.depth)
        if self.config.tie_embeddings:
            self.head.out.weight = self.embed.tokens.weight

    @property
    def context(self) -> int:
        """Longest sequence the model accepts."""
        return self.config.context

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary (logits per position)."""
        return self.config.vocab_size

    def forward(self, ids: Tensor) -> Tensor:
        """Next-token logits ``(B, T, vocab)`` for token ids ``(B, T)``."""
        return self.head(run_stack(self.layers, self.embed(ids)))


class RevTransformerLM(_LanguageModel):
    """Reversible decoder-only Transformer (Reformer without LSH attention); see the module doc.

    Module names: ``embed``, ``layers`` (a :class:`~revtrain.core.ReversibleSequence`; block
    ``i`` is ``layers.blocks.i`` with ``f`` the attention and ``g`` the feed-forward), ``head``.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.layers = ReversibleSequence(
            [ReversibleBlock(*config.layer(), split_dim=-1, preserve_rng_state=config.dropout > 0)  # replay dropout
             for _ in range(config.depth)]
        )
        self._finish()


class ResidualLayer(nn.Module):
    """A plain pre-LN Transformer layer: ``x = x + attn(x); x = x + ff(x)``."""

    def __init__(self, attn: nn.Module, ff: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.ff = ff

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x)
        return x + self.ff(x)


class TransformerLM(_LanguageModel):
    """The plain twin of :class:`RevTransformerLM`: same modules, ordinary residuals."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.layers = nn.Sequential(*(ResidualLayer(*config.layer()) for _ in range(config.depth)))
        self._finish()


# ----------------------------------------------------------------------------- the zoo

_OPTIONS = {f.name for f in fields(TransformerConfig)} - {"width", "depth", "heads", "ff_mult"}

_TINY = dict(context=16, width=16, depth=2, heads=2)
# Sized by training for 3 minutes on the 2-core CPU (1 thread, M-mode, default corpus): width 64
# reached 2.56 validation bits per byte, width 96 2.74 (both batch 32), width 128 2.97 (batch
# 16): a wider model takes fewer steps in the same time.
_SMALL = dict(context=128, width=64, depth=4, heads=4)
# Jiang et al. 2021 §4.5: 12 layers, 8 heads, sequences of 4,096, 256 tokens. The width and
# the 4x feed-forward are those of the reformer-pytorch enwik8 example the paper adapted.
_ENWIK8 = dict(context=4096, width=512, depth=12, heads=8)
_JIANG = "Jiang et al. 2021, §4.5 / Table 2 (Reformer on enwik8)"
_OURS = "revtrain (Reformer-style, sized for a CPU)"


def _build(cls: type[_LanguageModel], shape: dict[str, int], options: dict[str, object]) -> _LanguageModel:
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(
            f"unexpected option(s) {unknown} for a registered language model; it accepts "
            f"{sorted(_OPTIONS)} (width, depth and heads are fixed by its name: build "
            "RevTransformerLM(TransformerConfig(...)) for another shape)"
        )
    return cls(TransformerConfig(**{**shape, **options}))  # type: ignore[arg-type]


@register_model(reversible=True, dataset="text (bytes)", inputs=token_input(16, 256), paper=_OURS)
def revformer_tiny(**options: object) -> RevTransformerLM:
    """Reversible byte-level LM for tests: 2 layers, width 16, 2 heads, context 16."""
    return _build(RevTransformerLM, _TINY, options)  # type: ignore[return-value]


@register_model(reversible=False, dataset="text (bytes)", inputs=token_input(16, 256), paper=_OURS)
def transformer_tiny(**options: object) -> TransformerLM:
    """Plain twin of revformer_tiny: 2 layers, width 16, 2 heads, context 16."""
    return _build(TransformerLM, _TINY, options)  # type: ignore[return-value]


@register_model(reversible=True, dataset="text (bytes)", inputs=token_input(128, 256), paper=_OURS)
def revformer_small(**options: object) -> RevTransformerLM:
    """Reversible byte-level LM that trains on a CPU in minutes: 4 layers, width 64, 4 heads, context 128."""
    return _build(RevTransformerLM, _SMALL, options)  # type: ignore[return-value]


@register_model(reversible=False, dataset="text (bytes)", inputs=token_input(128, 256), paper=_OURS)
def transformer_small(**options: object) -> TransformerLM:
    """Plain twin of revformer_small: 4 layers, width 64, 4 heads, context 128."""
    return _build(TransformerLM, _SMALL, options)  # type: ignore[return-value]


@register_model(reversible=True, dataset="enwik8", inputs=token_input(4096, 256), paper=_JIANG)
def revformer_enwik8(**options: object) -> RevTransformerLM:
    """The paper's Reformer shape: 12 reversible layers, 8 heads, width 512, context 4096, 256 bytes."""
    return _build(RevTransformerLM, _ENWIK8, options)  # type: ignore[return-value]


@register_model(reversible=False, dataset="enwik8", inputs=token_input(4096, 256), paper=_JIANG)
def transformer_enwik8(**options: object) -> TransformerLM:
    """Plain twin of revformer_enwik8: 12 layers, 8 heads, width 512, context 4096."""
    return _build(TransformerLM, _ENWIK8, options)  # type: ignore[return-value]
