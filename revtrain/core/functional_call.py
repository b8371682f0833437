"""The ``functional_call`` hook: M-mode rebuilds with the tensors its forward ran with.

``torch.func.functional_call`` (meta-learning, ensembling) swaps substitute parameters and
buffers into the modules for the forward only, so a rebuild in backward would otherwise run with
the modules' own tensors. The forward records what every submodule held
(:meth:`ModuleTensors.capture`); the backward puts those tensors back for the rebuild
(:meth:`ModuleTensors.in_place`, a no-op when nothing was swapped) and restores what it found.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = ["ModuleTensors"]


@dataclass(frozen=True)
class ModuleTensors:
    """The parameters and buffers the modules of a run held when its forward ran."""

    entries: tuple[tuple[dict[str, Any], str, Tensor | None], ...]
    """``(module._parameters or module._buffers, name, tensor)`` for each tensor."""

    @classmethod
    def capture(cls, modules: Iterable[nn.Module]) -> ModuleTensors:
        return cls(tuple([(d, name, t) for m in modules for d in (m._parameters, m._buffers) for name, t in d.items()]))

    @contextlib.contextmanager
    def in_place(self) -> Iterator[None]:
        """Run the body with the recorded tensors back in the modules."""
        swapped = [(d, name, t, d.get(name)) for d, name, t in self.entries if d.get(name) is not t]
        for d, name, t, _ in swapped:
            d[name] = t
        try:
            yield
        finally:
            for d, name, _, now in swapped:
                d[name] = now
