"""revtrain: train reversible neural networks fast and in little memory."""

from revtrain._version import __version__
from revtrain.core import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    Invertible,
    ReversibleBlock,
    ReversibleSequence,
    get_modes,
    reverse_step,
    reversible_blocks,
    set_modes,
    set_rebuild_checks,
    verify_invertible,
)
from revtrain.models import create_model, list_models, model_info, register_model
from revtrain.planner import Plan, Profile, make_plan, solve_knapsack
from revtrain.errors import (
    NotInvertibleError,
    ReconstructionDriftWarning,
    ReconstructionError,
    ReversibilityError,
    RevtrainError,
)

__all__ = [
    "AdditiveCoupling",
    "export",
    "load",
    "AffineCoupling",
    "Coupling",
    "create_model",
    "get_modes",
    "Invertible",
    "list_models",
    "make_plan",
    "model_info",
    "NotInvertibleError",
    "Plan",
    "Profile",
    "ReconstructionDriftWarning",
    "ReconstructionError",
    "register_model",
    "ReversibilityError",
    "reversible_blocks",
    "ReversibleBlock",
    "ReversibleSequence",
    "reverse_step",
    "RevtrainError",
    "set_modes",
    "set_rebuild_checks",
    "solve_knapsack",
    "verify_invertible",
    "__version__",
]


def __getattr__(name: str) -> object:
    """``revtrain.load`` and ``revtrain.export`` (:mod:`revtrain.train.export`), imported on first
    use: ``import revtrain`` stays light for library users who never train."""
    if name in ("load", "export"):
        from revtrain.train.export import export, load

        return {"load": load, "export": export}[name]
    raise AttributeError(f"module 'revtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What ``dir(revtrain)`` and ``help`` list: the public names, the lazy ones included."""
    return sorted(set(globals()) | set(__all__))
