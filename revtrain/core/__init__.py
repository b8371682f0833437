"""The reversible core: couplings, blocks, invertible layers, sequences, modes, verification.

Floors, each importing only those below it (no circles):
``fixed_point`` -> ``coupling``; ``arguments``, ``replay``, ``checks``, ``handoff`` -> ``step``
(the protocol and the public rebuild step) -> ``function`` (the M-mode autograd function) ->
``invertible`` (the base of every layer with a mode) -> ``block`` -> ``sequence`` -> ``modes``
-> ``verify``.
"""

from revtrain.core.block import ReversibleBlock, split_halves
from revtrain.core.arguments import ExtraArgs
from revtrain.core.coupling import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ExactAdditiveCoupling,
    InverseCoupling,
    get_coupling,
)
from revtrain.core.fixed_point import FixedPointGrid
from revtrain.core.invertible import MODES, Invertible, Mode, trainable_params
from revtrain.core.modes import get_modes, reversible_blocks, set_modes, set_rebuild_checks, use_exact_couplings
from revtrain.core.sequence import ReversibleSequence
from revtrain.core.step import ReversibleStep, StepResult, reverse_step
from revtrain.core.verify import BlockCheck, VerificationReport, verify_invertible

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "BlockCheck",
    "Coupling",
    "ExactAdditiveCoupling",
    "ExtraArgs",
    "FixedPointGrid",
    "InverseCoupling",
    "Invertible",
    "MODES",
    "Mode",
    "ReversibleBlock",
    "ReversibleSequence",
    "ReversibleStep",
    "StepResult",
    "VerificationReport",
    "get_coupling",
    "get_modes",
    "reverse_step",
    "reversible_blocks",
    "set_modes",
    "set_rebuild_checks",
    "split_halves",
    "trainable_params",
    "use_exact_couplings",
    "verify_invertible",
]
