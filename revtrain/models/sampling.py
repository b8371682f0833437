"""Generate tokens from a language model: greedy, temperature and top-k sampling.

Works with any model that maps token ids ``(B, T)`` to logits ``(B, T, vocab)`` (every
registered language model). Each new token is predicted from the last ``context`` tokens,
with the whole window run again per token (no key/value cache: simple, and fast enough for a
few hundred bytes from a small model).

Example::

    model = create_model("revformer_small")
    model.load_state_dict(...)
    print(sample_text(model, "def main(", 200, temperature=0.8, top_k=40, seed=0))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["generate", "sample_text"]


def generate(
    model: nn.Module,
    prompt: Tensor | Sequence[int],
    length: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    context: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``length`` new token ids following ``prompt``.

    Args:
        model: Maps ids ``(B, T)`` to logits ``(B, T, vocab)``. Run in eval mode without
            gradients; its training mode is restored afterwards.
        prompt: The ids of one sequence to continue (1-D or ``1 x T``), at least one.
        length: How many ids to generate.
        temperature: Divides the logits; ``0`` picks the most likely id (greedy).
        top_k: Sample only among the ``top_k`` most likely ids.
        context: Longest input the model takes (default: ``model.context``); older ids are
            dropped from the window.
        generator: Source of the random draws, for reproducible samples (a CPU generator).

    Returns:
        The generated ids, int64 ``(length,)``, on the CPU.
    """
    ids = torch.as_tensor(prompt, dtype=torch.int64)
    if ids.dim() > 1 and (ids.dim() > 2 or ids.shape[0] != 1):
        raise ValueError(f"generate continues one prompt; got ids of shape {tuple(ids.shape)}: pass one sequence "
                         "(1-D, or 1 x T) and call it once per prompt")
    ids = ids.flatten().cpu()
    if ids.numel() == 0:
        raise ValueError("the prompt is empty; give at least one token to continue (e.g. a newline)")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    context = context or getattr(model, "context", None)
    if not context:
        raise ValueError("the model has no `context` attribute: is it a language model (`revtrain models`)? "
                         "For one of your own, pass context= (its longest input)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(length):
                window = ids[-context:].to(device)[None]  # (1, T)
                logits = model(window)[0, -1].double().cpu()  # (vocab,)
                ids = torch.cat([ids, _pick(logits, temperature, top_k, generator)])
    finally:
        model.train(was_training)
    return ids[ids.numel() - length:]


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    if temperature == 0:
        return logits.argmax().reshape(1)
    if top_k is not None and top_k < logits.numel():
        threshold = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def sample_text(
    model: nn.Module,
    prompt: str | bytes,
    length: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
) -> str:
    """Continue a text prompt with a byte-level model and return prompt + continuation as text.

    The prompt is encoded as UTF-8 (an empty prompt starts from a newline); the bytes are
    decoded as UTF-8 with invalid sequences shown as U+FFFD, since a byte model may stop
    mid-character or invent invalid sequences.
    """
    vocab = getattr(model, "vocab_size", 256)
    if vocab > 256:
        raise ValueError(f"sample_text is for byte-level models (vocabulary <= 256), this one has {vocab}; "
                         "use generate() and your own decoding")
    data = prompt.encode() if isinstance(prompt, str) else bytes(prompt)
    data = data or b"\n"
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    new = generate(model, list(data), length, temperature=temperature, top_k=top_k, generator=generator)
    return (data + bytes(new.tolist())).decode("utf-8", errors="replace")
