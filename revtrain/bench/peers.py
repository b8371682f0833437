"""The peer libraries as anchors: the same coupling stack built with revlib, memcnn,
reformer-pytorch and RevTorch, on the very F/G modules revtrain's stack uses.

Each builder returns a module mapping ``x (B, C, H, W) -> y (B, C, H, W)`` that computes
``y1 = x1 + F(x2); y2 = x2 + G(y1)`` block after block, split along channels, exactly as
revtrain's :class:`~revtrain.core.ReversibleSequence` does, so the stack benchmark checks each
peer's gradients against plain autograd before timing it. The peers are not dependencies of
revtrain; install them for benchmarks with ``pip install --no-deps`` (see benchmarks/README.md).
A peer that is missing is reported by :func:`peer_status`, and the benchmark leaves it out.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

from torch import Tensor, nn

__all__ = ["PEERS", "peer_status", "build_peer", "installed_peers"]

PEERS: tuple[str, ...] = ("revlib", "memcnn", "reformer", "revtorch")
"""Peer methods the stack benchmark knows, in table order."""

_MODULES = {"revlib": "revlib", "memcnn": "memcnn", "reformer": "reformer_pytorch", "revtorch": "revtorch"}


def peer_status(name: str) -> str | None:
    """None when ``name`` can be built here, else why not (for the results' notes)."""
    if name not in _MODULES:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    if importlib.util.find_spec(_MODULES[name]) is None:
        return f"{name} is not installed (pip install --no-deps, see benchmarks/README.md)"
    try:
        _BUILDERS[name]  # noqa: B018 - the table below
        if name == "reformer":
            from reformer_pytorch.reversible import ReversibleSequence  # noqa: F401
        else:
            importlib.import_module(_MODULES[name])
    except Exception as err:  # an installed peer that cannot import here: say why
        return f"{name} does not import: {type(err).__name__}: {err}"
    return None


def installed_peers() -> list[str]:
    """The peers that can be built here, in table order."""
    return [name for name in PEERS if peer_status(name) is None]


def build_peer(name: str, fgs: Sequence[tuple[nn.Module, nn.Module]]) -> nn.Module:
    """The stack of ``(F, G)`` pairs as peer ``name`` builds it (shares the modules)."""
    problem = peer_status(name)
    if problem:
        raise RuntimeError(problem)
    return _BUILDERS[name](fgs)


def _revlib(fgs: Sequence[tuple[nn.Module, nn.Module]]) -> nn.Module:
    import revlib

    # revlib applies its modules alternately to the two streams: (x1, x2) -> (x2, x1 + F(x2))
    # -> (y1, x2 + G(y1)), so F1, G1, F2, G2, ... computes our blocks; outputs (y1, y2).
    return revlib.ReversibleSequential(*(m for fg in fgs for m in fg), split_dim=1)


class _CloneInput(nn.Module):
    """memcnn frees its input's storage after the forward (``keep_input=False``); the benchmark's
    input is shared by every method, so memcnn gets a copy (one activation-sized copy per step)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x.clone())


def _memcnn(fgs: Sequence[tuple[nn.Module, nn.Module]]) -> nn.Module:
    import memcnn

    return _CloneInput(nn.Sequential(*(
        memcnn.InvertibleModuleWrapper(memcnn.AdditiveCoupling(Fm=f, Gm=g), keep_input=False,
                                       keep_input_inverse=False)
        for f, g in fgs
    )))


class _FlatToMap(nn.Module):
    """Reformer splits its stream along dim 2 (the features of a (B, T, D) sequence). A conv
    stack is fed as ``(B, 1, C*H*W)``: splitting that along dim 2 gives exactly the channel
    halves, and views (no copies) turn them back into feature maps for F and G."""

    def __init__(self, fn: nn.Module, shape: Callable[[], tuple[int, int, int]]) -> None:
        super().__init__()
        self.fn = fn
        self._shape = shape

    def forward(self, x: Tensor) -> Tensor:
        c, h, w = self._shape()
        out = self.fn(x.view(x.shape[0], c, h, w))  # (B, C/2, H, W)
        return out.view(x.shape[0], 1, -1)


class _ReformerStack(nn.Module):
    def __init__(self, fgs: Sequence[tuple[nn.Module, nn.Module]]) -> None:
        super().__init__()
        from reformer_pytorch.reversible import ReversibleSequence

        self._half: tuple[int, int, int] = (0, 0, 0)
        shape = lambda: self._half  # noqa: E731 - set per call, read by the adapters
        self.seq = ReversibleSequence([(_FlatToMap(f, shape), _FlatToMap(g, shape)) for f, g in fgs])

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        self._half = (c // 2, h, w)
        return self.seq(x.reshape(b, 1, c * h * w)).view(b, c, h, w)


def _reformer(fgs: Sequence[tuple[nn.Module, nn.Module]]) -> nn.Module:
    return _ReformerStack(fgs)


def _revtorch(fgs: Sequence[tuple[nn.Module, nn.Module]]) -> nn.Module:
    import revtorch

    blocks = nn.ModuleList([revtorch.ReversibleBlock(f, g, split_along_dim=1) for f, g in fgs])
    return revtorch.ReversibleSequence(blocks)


_BUILDERS: dict[str, Callable[[Sequence[tuple[nn.Module, nn.Module]]], nn.Module]] = {
    "revlib": _revlib,
    "memcnn": _memcnn,
    "reformer": _reformer,
    "revtorch": _revtorch,
}
