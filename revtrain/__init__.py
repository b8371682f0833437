"""revtrain: train reversible neural networks fast and in little memory."""

from revtrain._version import __version__
from revtrain.core import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ReversibleBlock,
    ReversibleSequence,
    get_modes,
    reversible_blocks,
    set_modes,
    verify_invertible,
)
from revtrain.errors import (
    NotInvertibleError,
    ReconstructionDriftWarning,
    ReconstructionError,
    ReversibilityError,
    RevtrainError,
)

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "Coupling",
    "NotInvertibleError",
    "ReconstructionDriftWarning",
    "ReconstructionError",
    "ReversibilityError",
    "ReversibleBlock",
    "ReversibleSequence",
    "RevtrainError",
    "__version__",
    "get_modes",
    "reversible_blocks",
    "set_modes",
    "verify_invertible",
]
