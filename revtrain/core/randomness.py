"""Which modules draw random numbers: what lets an M-mode forward skip capturing the generators.

A reversible block's M-mode forward captures the random generators before ``F`` and before
``G`` and compares them after, so that the rebuild in backward replays dropout exactly
(:class:`~revtrain.core.replay.RngState`). Those three captures and two comparisons cost ~13 µs
of Python per block alone and ~50 µs inside a step, where Python runs right after a block's
kernels (at batch 8, 16 channels, 8×8, depth 16 they were 0.8 ms of a 9 ms forward). Where
nothing below a block can draw random numbers, there is nothing to capture.

A module's own forward draws none when:

- its type is exactly one of torch's layers that never do (:data:`RANDOM_FREE_TYPES`:
  convolutions, linear layers, norms, activations other than RReLU, pooling, padding,
  ``Identity``, ``Flatten``...). Exactly: a subclass may override what ``forward`` calls;
- it is an ``nn.Sequential`` whose class keeps Sequential's ``forward``, iteration and call
  (the zoo's residual branches): it only calls its children, which are judged themselves;
- its class says so in its own body, ``draws_random_numbers = False`` (not inherited: a
  subclass may add randomness). ``True`` there, or no word at all for any other type, counts as
  drawing.

A ``forward`` set on the instance (a monkeypatch) runs instead of the class's and is not
trusted, except where :func:`revtrain.compile_model` set it to the compiled class forward.
A forward hook or pre-hook on any module, or a global module hook, may draw random numbers too:
then the generators are captured as before. Dropout, ``nn.MultiheadAttention`` (dropout inside)
and anything unknown keep the capture, so exact replay never depends on this list being complete,
only on its members being right.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar, Token

from torch import nn

__all__ = ["RANDOM_FREE_TYPES", "COMPILED_FORWARD", "draws_no_random_numbers", "no_module_draws_random_numbers",
           "known_random_free", "enter_random_free", "leave_random_free"]

RANDOM_FREE_TYPES: frozenset[type[nn.Module]] = frozenset({
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Linear, nn.Bilinear, nn.Embedding,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, nn.RMSNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.Threshold, nn.GLU, nn.LogSigmoid, nn.Softmax, nn.LogSoftmax,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d,
    nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d,
    nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle,
    nn.Identity, nn.Flatten, nn.Unflatten, nn.ModuleList, nn.ModuleDict, nn.Sequential,
})
"""torch layers whose forward never draws random numbers (matched by exact type)."""


def draws_no_random_numbers(module: nn.Module) -> bool:
    """Whether ``module``'s own forward provably draws no random numbers (its children and
    hooks aside; see the module docstring for the rules)."""
    kind = type(module)
    own = module.__dict__
    if "forward" in own or "_call_impl" in own:
        # A forward set on the instance (a monkeypatch, accelerate's hooks) runs instead of the
        # class's: unknown, unless it is revtrain.compile_model's compiled class forward.
        if "_call_impl" in own or not _compiled_class_forward(module, kind):
            return False
    if kind in RANDOM_FREE_TYPES:
        return True
    said = kind.__dict__.get("draws_random_numbers")
    if said is not None:
        return said is False
    return (
        isinstance(module, nn.Sequential)
        and kind.forward is nn.Sequential.forward
        and kind.__iter__ is nn.Sequential.__iter__
        and kind.__call__ is nn.Module.__call__
        and kind._call_impl is nn.Module._call_impl
    )


COMPILED_FORWARD = "_revtrain_forward_from"
"""Where :func:`revtrain.compile_model` notes, on a module, ``(compiled function, class
forward it compiled)`` for the forward it sets on the instance."""


def _compiled_class_forward(module: nn.Module, kind: type) -> bool:
    """Whether the instance's forward is ``compile_model``'s compilation of the class's own
    forward (the same computation: what the class's forward draws, it draws)."""
    origin = module.__dict__.get(COMPILED_FORWARD)
    forward = module.__dict__.get("forward")
    return (
        isinstance(origin, tuple) and len(origin) == 2
        and getattr(forward, "__func__", None) is origin[0]
        and origin[1] is kind.forward
    )


def no_module_draws_random_numbers(modules: Iterable[nn.Module]) -> bool:
    """Whether none of ``modules`` can draw random numbers in a forward: each draws none itself
    (:func:`draws_no_random_numbers`), none has forward hooks and no global module hook is set."""
    if _global_hooks():
        return False
    return all(
        not (m._forward_hooks or m._forward_pre_hooks) and draws_no_random_numbers(m) for m in modules
    )


def _global_hooks() -> bool:
    module = nn.modules.module
    return bool(getattr(module, "_global_forward_hooks", None) or getattr(module, "_global_forward_pre_hooks", None))


_KNOWN_RANDOM_FREE: ContextVar[bool] = ContextVar("revtrain_known_random_free", default=False)


def known_random_free() -> bool:
    """Whether the M-mode step running now is known to draw no random numbers below it (set
    around each step's forward by the M-mode run, from :func:`no_module_draws_random_numbers`
    over the step's modules; False outside)."""
    return _KNOWN_RANDOM_FREE.get()


def enter_random_free(random_free: bool) -> Token[bool]:
    """Say, for the step forward that follows, whether its modules draw no random numbers;
    :func:`leave_random_free` with the returned token undoes it. A pair of calls rather than a
    context manager: this runs around every M-mode step in every forward."""
    return _KNOWN_RANDOM_FREE.set(random_free)


def leave_random_free(token: Token[bool]) -> None:
    """Undo :func:`enter_random_free`."""
    _KNOWN_RANDOM_FREE.reset(token)
