"""Find the reversible layers of any model and read or set their modes by module name.

A reversible layer is any :class:`~revtrain.core.Invertible`: coupling blocks
(:class:`~revtrain.core.ReversibleBlock`) and invertible layers alike.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from revtrain.core.block import ReversibleBlock
from revtrain.core.coupling import AdditiveCoupling, ExactAdditiveCoupling
from revtrain.core.invertible import Invertible, Mode, normalize_mode

__all__ = ["reversible_blocks", "set_modes", "get_modes", "use_exact_couplings"]


def reversible_blocks(model: nn.Module) -> list[tuple[str, Invertible]]:
    """Every reversible layer (``Invertible``: coupling blocks and invertible layers) in
    ``model``, in module order, with its ``named_modules`` name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Invertible)]


def get_modes(model: nn.Module) -> dict[str, Mode]:
    """The mode of every reversible block, keyed by module name."""
    return {name: block.mode for name, block in reversible_blocks(model)}


def set_modes(model: nn.Module, modes: str | Mapping[str, str]) -> dict[str, Mode]:
    """Set every block to one mode (``"M"``/``"C"``), or blocks by name from a mapping.

    A mapping must name only blocks that exist; blocks it does not name keep their mode.
    Returns the modes now in force. Raises ``ValueError`` naming unknown blocks (the mapping
    was probably made for another model) before changing anything.
    """
    blocks = dict(reversible_blocks(model))
    if isinstance(modes, str):
        mode = normalize_mode(modes)
        for block in blocks.values():
            block.mode = mode
        return get_modes(model)
    unknown = sorted(set(modes) - set(blocks))
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        known = ", ".join(list(blocks)[:3]) + (" ..." if len(blocks) > 3 else "")
        raise ValueError(
            f"{len(unknown)} block name(s) not in this model: {shown}. The model's reversible "
            f"blocks are named like: {known or '(none)'}. Was the plan made for another model?"
        )
    normalized = {name: normalize_mode(m) for name, m in modes.items()}
    for name, mode in normalized.items():
        blocks[name].mode = mode
    return get_modes(model)


def use_exact_couplings(model: nn.Module, fraction_bits: int = 12) -> int:
    """Put every additive coupling block of ``model`` on a fixed-point grid (exact rebuilds).

    Each :class:`~revtrain.core.ReversibleBlock` with an additive coupling gets an
    :class:`~revtrain.core.ExactAdditiveCoupling` with ``fraction_bits``; the network becomes
    its quantised twin (activations rounded to multiples of ``2**-fraction_bits``), whose
    M-mode gradients equal its C-mode gradients bit for bit. Returns the number of blocks
    changed. Raises ``ValueError`` before changing anything if a block uses another coupling
    (affine couplings multiply, which no fixed-point grid keeps exact).
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
