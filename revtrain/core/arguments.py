"""Extra arguments of a reversible layer, passed on to ``F`` and ``G`` (masks, positions, conditioning).

``block(x, mask, positions=pos)`` calls ``F(x2, mask, positions=pos)`` and ``G(y1, mask,
positions=pos)``; M-mode replays them in the rebuild and their tensors get gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["ExtraArgs", "NO_ARGS"]


@dataclass(frozen=True)
class ExtraArgs:
    """Positional and keyword arguments for ``F`` and ``G``, tensors flattened out.

    Build one with :meth:`of`; :attr:`tensors` are the tensor leaves in a fixed order, and
    :meth:`with_tensors` puts other tensors (detached copies that require grad, in the rebuild)
    in their places.
    """

    args: tuple[Any, ...] = ()
    """Positional arguments after the input."""
    kwargs: dict[str, Any] | None = None
    """Keyword arguments (None: none)."""

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExtraArgs:
        return NO_ARGS if not args and not kwargs else cls(tuple(args), dict(kwargs))

    def __bool__(self) -> bool:
        return bool(self.args or self.kwargs)

    @property
    def tensors(self) -> list[Tensor]:
        """The tensors among the arguments (nested in lists, tuples and dicts too), in order."""
        if not self:
            return []
        leaves = pytree.tree_leaves((self.args, self.kwargs or {}))
        return [leaf for leaf in leaves if isinstance(leaf, Tensor)]

    def with_tensors(self, tensors: list[Tensor] | tuple[Tensor, ...]) -> ExtraArgs:
        """The same arguments with their tensors replaced, in :attr:`tensors` order."""
        if not self:
            return self
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs or {}))
        replacements = iter(tensors)
        new = [next(replacements) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        args, kwargs = pytree.tree_unflatten(new, spec)
        return ExtraArgs(tuple(args), dict(kwargs))

    def call(self, fn: Any, inp: Tensor) -> Any:
        """``fn(inp, *args, **kwargs)``."""
        if not self:
            return fn(inp)
        return fn(inp, *self.args, **(self.kwargs or {}))


NO_ARGS = ExtraArgs()
"""No extra arguments: ``F(x2)``, ``G(y1)``."""
