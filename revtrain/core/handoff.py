"""What an M-mode run keeps of its output, and how the next M-mode run takes it over.

When an M-mode run's output is the input of another M-mode run (blocks chained in any
container), the later run (the *taker*) rebuilds that tensor in its own backward, so the earlier
run (the *producer*) drops its copy and the taker hands the rebuilt tensor over (autograd runs a
node only after every consumer of its output). Otherwise the producer uses, in order: the tensor
handed over; its own copy; the output itself if still held unchanged; a rebuild from the taker's
output; else a :class:`~revtrain.errors.ReconstructionError` saying what happened.

Outputs are kept through saved-tensor hooks that wrap each in a :class:`Kept` holder: autograd
owns it like any saved tensor, the run's node holds a weak reference, a taker can empty it, and
the caller's own hooks still pack it. Version counters are checked by hand (in-place edits of a
kept output are refused).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Kept", "keep_saved", "find_producer", "same_views", "kept_tensors"]

_EMPTY = torch.empty(0)


class Kept:
    """A saved tensor that its owner's taker may drop: the tensor itself, or what the caller's
    own saved-tensor hooks (``save_on_cpu``, a profiler) made of it."""

    __slots__ = ("packed", "alias", "version", "outer_unpack", "__weakref__")

    def __init__(self, tensor: Tensor, outer: tuple[Callable[..., Any], Callable[..., Any]] | None) -> None:
        self.version = tensor._version
        if outer is None:
            self.packed: Any = tensor
            self.alias: Tensor | None = tensor  # shares the version counter of the saved tensor
            self.outer_unpack = None
        else:
            self.packed = outer[0](tensor)
            self.alias = None  # the caller's hooks own it (it may live on another device)
            self.outer_unpack = outer[1]

    @property
    def dropped(self) -> bool:
        return self.packed is None

    def drop(self) -> None:
        self.packed = None
        self.alias = None

    def modified(self) -> bool:
        """Whether the saved tensor was changed in place since (known only without outer hooks)."""
        return self.alias is not None and self.alias._version != self.version

    def value(self) -> Tensor:
        if self.packed is None:
            return _EMPTY
        return self.outer_unpack(self.packed) if self.outer_unpack is not None else self.packed


@contextlib.contextmanager
def keep_saved() -> Iterator[list[Kept] | None]:
    """Wrap every tensor saved in the body in a :class:`Kept` holder (packed with the caller's
    hooks, if any); yield the holders, or None where saved-tensor hooks are disabled (then the
    run saves plainly and is never taken over)."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        yield None
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    holders: list[Kept] = []

    def pack(t: Tensor) -> Kept:
        holder = Kept(t, outer)
        holders.append(holder)
        return holder

    def unpack(holder: Kept) -> Tensor:
        return holder.value()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield holders


def kept_tensors(refs: Sequence[weakref.ref[Kept]] | None) -> list[Kept | None]:
    """The holders behind weak references (None where autograd freed them)."""
    return [ref() for ref in refs] if refs is not None else []


def find_producer(source: Any, backward_cls: type) -> Any | None:
    """The node of the M-mode run whose complete, unmodified output is ``source`` (a tensor or
    a tuple, output ``k`` at position ``k``), or None."""
    tensors = source if isinstance(source, (tuple, list)) else (source,)
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        return None
    node = tensors[0].grad_fn
    if not isinstance(node, backward_cls) or getattr(node, "kept_refs", None) is None:
        return None
    if getattr(node, "n_outputs", -1) != len(tensors):
        return None
    for k, t in enumerate(tensors):
        if t.grad_fn is not node or t.output_nr != k:
            return None
    taker = node.taker() if node.taker is not None else None
    return node if taker is None else None


def same_views(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """Whether two states are the same tensors (same memory, shape and strides)."""
    return len(a) == len(b) and all(
        x.data_ptr() == y.data_ptr()
        and x.shape == y.shape
        and x.stride() == y.stride()
        and x.dtype == y.dtype
        for x, y in zip(a, b)
    )
