"""Find the reversible layers (every :class:`~revtrain.core.Invertible`) of any model and read
or set their modes and rebuild checks by module name."""

from __future__ import annotations

import operator
from collections.abc import Mapping

from torch import nn

from revtrain.core.block import ReversibleBlock
from revtrain.core.coupling import AdditiveCoupling, ExactAdditiveCoupling
from revtrain.core.invertible import Invertible, Mode, normalize_mode
from revtrain.errors import unknown_names_error

__all__ = ["reversible_blocks", "set_modes", "get_modes", "use_exact_couplings", "set_rebuild_checks"]


def reversible_blocks(model: nn.Module) -> list[tuple[str, Invertible]]:
    """Every reversible layer (``Invertible``: coupling blocks and invertible layers) in
    ``model``, in module order, with its ``named_modules`` name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Invertible)]


def get_modes(model: nn.Module) -> dict[str, Mode]:
    """The mode of every reversible block, keyed by module name."""
    return {name: block.mode for name, block in reversible_blocks(model)}


def set_modes(model: nn.Module, modes: str | Mapping[str, str]) -> dict[str, Mode]:
    """Set every block to one mode (``"M"``/``"C"``), or blocks by name from a mapping (others
    keep theirs); returns the modes now in force. Raises ``ValueError`` naming unknown blocks
    before changing anything."""
    blocks = dict(reversible_blocks(model))
    if isinstance(modes, str):
        mode = normalize_mode(modes)
        for block in blocks.values():
            block.mode = mode
        return get_modes(model)
    unknown = sorted(set(modes) - set(blocks))
    if unknown:
        raise unknown_names_error(unknown, list(blocks), "block", "reversible blocks")
    normalized = {name: normalize_mode(m) for name, m in modes.items()}
    for name, mode in normalized.items():
        blocks[name].mode = mode
    return get_modes(model)


def set_rebuild_checks(model: nn.Module, every: int | None) -> int:
    """Check the M-mode rebuilds of every reversible layer of ``model`` on one forward in ``every``.

    ``every=1`` checks every rebuild, ``every=k`` one forward in ``k`` (see ``check_every`` of
    :class:`~revtrain.core.Invertible`), ``every=0`` never: a rebuild that drifts or turns
    non-finite then goes unnoticed until the loss shows it. ``every=None`` restores the layers'
    default: the first few calls, then one in ``revtrain.core.checks.DEFAULT_EVERY``.

    Returns the number of layers set. Raises ``ValueError`` for anything but None or an integer
    >= 0, before changing anything.
    """
    try:
        count = -1 if every is None else operator.index(every)  # ints, numpy ints; not floats or strings
    except TypeError:
        count = -2
    if isinstance(every, bool) or count < -1 or (count == -1 and every is not None):
        raise ValueError(
            f"the rebuild check interval must be None (the default schedule) or an integer >= 0 (1: check "
            f"every M-mode step, k: one step in k, 0: never), got {every!r}"
        )
    layers = [layer for _, layer in reversible_blocks(model)]
    for layer in layers:
        layer.check_reconstruction = every is None or count > 0
        layer.check_every = None if every is None else max(count, 1)
    return len(layers)


def use_exact_couplings(model: nn.Module, fraction_bits: int = 12) -> int:
    """Put every additive coupling block of ``model`` on a fixed-point grid (exact rebuilds).

    The network becomes its quantised twin, whose M-mode gradients equal its C-mode gradients
    bit for bit. Returns the number of blocks changed; raises ``ValueError`` before changing
    anything if a block uses another coupling.
    """
    blocks = [m for _, m in reversible_blocks(model) if isinstance(m, ReversibleBlock)]
    others = [type(b.coupling).__name__ for b in blocks if not isinstance(b.coupling, AdditiveCoupling)]
    if others:
        raise ValueError(
            f"exact couplings replace additive ones only; this model has {len(others)} block(s) "
            f"with {sorted(set(others))}. Affine couplings multiply, which no fixed-point grid "
            "keeps exact: use float64 for those, or additive couplings"
        )
    for block in blocks:
        block.coupling = ExactAdditiveCoupling(fraction_bits)
    return len(blocks)
