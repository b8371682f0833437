"""The two residual functions of a Transformer layer, shared by every Transformer in the zoo.

:class:`SelfAttention` and :class:`FeedForward` each start with their own LayerNorm
(pre-LN), so one module is one residual branch: a plain Transformer adds them to its stream
(``x = x + attn(x); x = x + ff(x)``), and a reversible one uses them as the ``F`` and ``G``
of a :class:`~revtrain.core.ReversibleBlock` (``y1 = x1 + attn(x2); y2 = x2 + ff(y1)``).
They are pure functions of their input and weights (dropout draws from torch's generators,
which the core captures and replays), so the core can rebuild their inputs exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import ReversibleSequence
from revtrain.errors import RevtrainError

__all__ = [
    "FeedForward",
    "run_stack",
    "SelfAttention",
    "SequenceTooLongError",
    "apply_rotary",
    "check_heads",
    "init_transformer_weights",
]


class SequenceTooLongError(RevtrainError, ValueError):
    """A sequence is longer than the context the model was built for."""


def check_heads(width: int, heads: int, *, rotary: bool, owner: str) -> None:
    """Raise a clear error unless ``heads`` split ``width`` into usable head widths."""
    if width < 1 or heads < 1:
        raise ValueError(f"{owner}: width and heads must be positive, got width={width}, heads={heads}")
    if width % heads:
        divisors = [h for h in range(1, min(width, 64) + 1) if width % h == 0]
        raise ValueError(
            f"{owner}: heads={heads} does not divide width={width}; each head gets width/heads "
            f"features. Pick heads from {divisors[-6:]} or a width that is a multiple of {heads}"
        )
    if rotary and (width // heads) % 2:
        raise ValueError(
            f"{owner}: rotary positions rotate pairs of features, so the head width must be even; "
            f"width/heads = {width}/{heads} = {width // heads}. Use an even head width or "
            "positions='learned'"
        )


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotary position embedding (Su et al. 2021) of ``x`` ``(B, H, T, d)``, positions ``0..T-1``.

    Feature ``i`` and ``i + d/2`` of position ``t`` are rotated by the angle ``t * inv_freq[i]``
    (the "rotate half" layout of GPT-NeoX and LLaMA). Computed from ``T`` on every call, so a
    rebuild in backward needs nothing but the input.
    """
    length = x.shape[-2]
    positions = torch.arange(length, device=x.device, dtype=inv_freq.dtype)
    angles = torch.outer(positions, inv_freq)  # (T, d/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, d)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class SelfAttention(nn.Module):
    """Pre-LN multi-head self-attention: ``Attention(LN(x))`` for ``x`` of shape ``(B, T, D)``.

    Args:
        width: Features ``D`` of the stream.
        heads: Attention heads; must divide ``width``.
        causal: Each position attends only to itself and earlier ones (language models).
        dropout: Dropout on the attention probabilities and on the output projection; active
            only in training mode.
        rotary: Rotary position embedding on queries and keys (head width must be even).
        rotary_base: The rotary frequencies' base (10,000 as in the paper).
    """

    def __init__(
        self,
        width: int,
        heads: int,
        *,
        causal: bool,
        dropout: float = 0.0,
        rotary: bool = False,
        rotary_base: float = 10_000.0,
    ) -> None:
        super().__init__()
        check_heads(width, heads, rotary=rotary, owner="SelfAttention")
        self.heads = heads
        self.causal = causal
        self.dropout = dropout
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)
        self.rotary = rotary
        if rotary:
            head_width = width // heads
            inv_freq = rotary_base ** (-torch.arange(0, head_width, 2, dtype=torch.float32) / head_width)
            # Not persistent: a function of the architecture, not a learned or saved state.
            self.register_buffer("inv_freq", inv_freq, persistent=False)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, causal={self.causal}, dropout={self.dropout}, rotary={self.rotary}"

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, d/H) each
        if self.rotary:
            q, k = apply_rotary(q, self.inv_freq), apply_rotary(k, self.inv_freq)
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        out = out.transpose(1, 2).reshape(b, t, d)  # (B, T, D)
        return self.drop(self.proj(out))


class FeedForward(nn.Module):
    """Pre-LN position-wise feed-forward: ``W2 GELU(W1 LN(x))`` with dropout, ``x`` ``(B, T, D)``.

    Args:
        width: Features ``D`` of the stream.
        hidden: Features of the hidden layer (``4 * width`` in the zoo).
        dropout: Dropout on the output; active only in training mode.
        chunks: Apply the function to this many slices of the sequence one after another
            (Reformer's chunking). Every position is independent, so the result is the same;
            what changes is the size of the hidden activation alive at once when no graph is
            kept (M-mode forward, evaluation). See ``docs/models.md`` for what it saves.
    """

    def __init__(self, width: int, hidden: int, *, dropout: float = 0.0, chunks: int = 1) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"FeedForward: hidden must be positive, got {hidden}")
        if chunks < 1:
            raise ValueError(f"FeedForward: chunks must be >= 1 (1 = no chunking), got {chunks}")
        self.chunks = chunks
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"

    def _ff(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))

    def forward(self, x: Tensor) -> Tensor:
        if self.chunks == 1:
            return self._ff(x)
        return torch.cat([self._ff(part) for part in x.chunk(self.chunks, dim=1)], dim=1)


def init_transformer_weights(model: nn.Module, depth: int, std: float = 0.02) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms.

    The projections that write into the residual stream (attention ``proj``, feed-forward
    ``fc2``) start ``sqrt(2 * depth)`` times smaller, so the stream's variance does not grow
    with depth. Applied in module order, so two models built the same way from the same seed
    get the same weights.
    """
    residual_std = std / math.sqrt(2 * depth)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    for module in model.modules():
        if isinstance(module, SelfAttention):
            nn.init.normal_(module.proj.weight, std=residual_std)
        elif isinstance(module, FeedForward):
            nn.init.normal_(module.fc2.weight, std=residual_std)


def run_stack(layers: nn.Module, h: Tensor) -> Tensor:
    """Run a Transformer's layers on the embedded tokens ``h``.

    A reversible stack (:class:`~revtrain.core.ReversibleSequence`) carries two streams that both
    start as ``h`` (the pair form avoids concatenating them) and returns their mean; a plain
    stack maps ``h`` itself.
    """
    if isinstance(layers, ReversibleSequence):
        y1, y2 = layers((h, h))
        return 0.5 * (y1 + y2)
    return layers(h)
