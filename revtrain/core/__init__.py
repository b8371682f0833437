"""The reversible core: couplings, blocks, sequences, modes and verification."""

from revtrain.core.block import MODES, Mode, ReversibleBlock, split_halves
from revtrain.core.coupling import AdditiveCoupling, AffineCoupling, Coupling, get_coupling
from revtrain.core.modes import get_modes, reversible_blocks, set_modes
from revtrain.core.sequence import ReversibleSequence
from revtrain.core.verify import BlockCheck, VerificationReport, verify_invertible

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "BlockCheck",
    "Coupling",
    "MODES",
    "Mode",
    "ReversibleBlock",
    "ReversibleSequence",
    "VerificationReport",
    "get_coupling",
    "get_modes",
    "reversible_blocks",
    "set_modes",
    "split_halves",
    "verify_invertible",
]
