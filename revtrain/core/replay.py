"""State that a rebuild in backward must reproduce or leave alone.

Four things can differ between running ``F`` in the forward pass and running it again in
backward, and each is handled here:

- random numbers (dropout): :class:`RngState` captures the generators before ``F`` runs and
  replays them around the rebuild, then puts the generators back as they were (only where
  ``F`` moved them: a function without randomness has nothing to replay);
- autocast: :class:`AutocastState` records the forward's autocast settings and re-enters them;
- batch-norm running statistics: :func:`no_running_stat_updates` keeps the rebuild from
  updating them a second time, without writing to them;
- the parameters and buffers themselves: ``torch.func.functional_call`` (meta-learning,
  ensembling) swaps substitute tensors into the modules for the forward only, so backward would
  otherwise rebuild with the module's own tensors. :class:`ModuleTensors` records the tensors the
  forward ran with and puts them back in place for the rebuild.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from revtrain.core.randomness import no_module_draws_random_numbers

__all__ = ["RngState", "AutocastState", "autocast_device_type", "ModuleTensors", "no_running_stat_updates", "own_trainable_params", "submodules"]


def submodules(module: nn.Module) -> list[nn.Module]:
    """``list(module.modules())``: the module and its descendants, each once, in the same
    (depth-first) order, without the generators and name prefixes of ``named_modules``; M-mode
    walks each layer's modules in every forward, where that walk was 3-4% of a small step."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        out.append(m)
        for child in m._modules.values():
            if child is not None and id(child) not in seen:
                visit(child)

    visit(module)
    return out


def own_trainable_params(modules: Iterable[nn.Module]) -> list[Tensor]:
    """The parameters that require grad held by ``modules`` themselves (each module's own, not
    its children's: pass :func:`submodules` for a whole tree), each once, in order. One
    definition for ``trainable_params`` and the walk of :class:`ModuleTensors`, which must agree
    to the order (``revtrain.core.step.walk_gives_params``)."""
    seen: set[int] = set()
    out: list[Tensor] = []
    for m in modules:
        for p in m._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


@dataclass(slots=True)
class RngState:
    """The CPU generator state and, where used, the CUDA generator state of one device.

    Captured three times per M-mode block in every forward: a plain slotted class (a frozen
    dataclass's ``__init__`` cost as much as reading the generator) that reads the default
    generator directly (``torch.get_rng_state`` wraps that call). Not changed after capture.
    """

    cpu: Tensor
    cuda_device: int | None
    cuda: Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return cls(torch.default_generator.get_state(), index, torch.cuda.get_rng_state(index))
        return cls(torch.default_generator.get_state(), None, None)

    def same_as(self, other: RngState) -> bool:
        """Whether the generators are in the same state (nothing drew random numbers between
        the two captures)."""
        if not _same_bytes(self.cpu, other.cpu):
            return False
        return self.cuda is None or (other.cuda is not None and _same_bytes(self.cuda, other.cuda))

    @classmethod
    def around(cls, device: torch.device, fn: Any, *args: Any) -> tuple[Any, RngState | None]:
        """``fn(*args)`` and the generator state it started from, or None when it drew no
        random numbers (a rebuild then has nothing to replay: 5% of a small M-mode step went
        to replaying generators for functions without randomness)."""
        before = cls.capture(device)
        out = fn(*args)
        return out, None if before.same_as(cls.capture(device)) else before

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured generators; restore the current ones afterwards."""
        cpu_now = torch.get_rng_state()
        cuda_now = torch.cuda.get_rng_state(self.cuda_device) if self.cuda is not None else None
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.cuda_device)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            if cuda_now is not None:
                torch.cuda.set_rng_state(cuda_now, self.cuda_device)


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    """Equality of two generator states (contiguous CPU byte tensors, as the generators hand
    them out): C's ``memcmp`` on their memory, where the C library can be loaded.

    Two states are compared per M-mode block in every forward. Through numpy each comparison
    was four dispatched ops (``.numpy()`` detaches, converts and resolves conjugate and negative
    views), and capturing and comparing the generators took 2.8% of an M-mode step at batch 8,
    16 channels, 8×8 (in-process paired rounds against ``preserve_rng_state=False``).
    """
    n = a.numel()
    if n != b.numel() or a.dtype != b.dtype:
        return False
    if _memcmp is not None and a.is_cpu and b.is_cpu and a.is_contiguous() and b.is_contiguous():
        return _memcmp(a.data_ptr(), b.data_ptr(), n * a.element_size()) == 0
    return a.numpy().tobytes() == b.numpy().tobytes()


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's ``memcmp``, or None where it cannot be loaded (then numpy compares)."""
    try:
        libc = ctypes.cdll.msvcrt if os.name == "nt" else ctypes.CDLL(None)
        memcmp = libc.memcmp
    except (OSError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_memcmp = _load_memcmp()


def autocast_device_type(device_type: str) -> str:
    """The device type autocast knows ``device_type`` by (other devices: ``"cpu"``)."""
    return device_type if device_type in ("cuda", "cpu", "xpu", "mps") else "cpu"


@dataclass(frozen=True)
class AutocastState:
    """Autocast settings for one device type, read at forward time."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device: torch.device) -> AutocastState:
        device_type = autocast_device_type(device.type)
        return cls(
            device_type=device_type,
            enabled=torch.is_autocast_enabled(device_type),
            dtype=torch.get_autocast_dtype(device_type),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )

    def context(self) -> contextlib.AbstractContextManager[None]:
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache_enabled
        )


def _stat_norms(modules: Iterable[nn.Module]) -> list[_NormBase]:
    return [
        m
        for module in modules
        for m in module.modules()
        if isinstance(m, _NormBase) and m.training and m.track_running_stats
    ]


@contextlib.contextmanager
def no_running_stat_updates(*modules: nn.Module) -> Iterator[None]:
    """Run the body without updating the running statistics of norm layers in ``modules``.

    Batch norm in training mode normalises with the statistics of the batch it sees, so a
    rebuild computes the same outputs as the forward whether or not it also updates the running
    averages. The rebuild must not update them a second time, and it must not write to them
    either: other pending graphs (a weight-tied block run in C-mode, a second backward with
    ``retain_graph=True``) saved those very tensors, and an in-place write would bump their
    version counters. So instead of saving and restoring the statistics, the layers are told
    not to track them for the duration (``track_running_stats = False`` in training mode means
    "use the batch statistics, update nothing"); no tensor is touched.
    """
    norms = _stat_norms(modules)
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


@dataclass(frozen=True)
class ModuleTensors:
    """The parameters and buffers every submodule of a module held when the forward ran, and
    the norm layers that updated running statistics in it (found in the same walk, so that
    backward does not walk the modules again)."""

    entries: tuple[tuple[dict[str, Any], str, Tensor | None], ...]
    """``(module._parameters or module._buffers, name, tensor)`` for each tensor."""
    stat_norms: tuple[_NormBase, ...] = ()
    """Norm layers in training mode that track running statistics (the rebuild must not)."""
    random_free: bool = False
    """No module below the captured one can draw random numbers in a forward
    (:func:`~revtrain.core.randomness.no_module_draws_random_numbers`): the step need not
    capture the generators for its rebuild."""
    params: tuple[Tensor, ...] = ()
    """The trainable parameters of the module and its submodules, each once, in module order
    (what ``trainable_params(module)`` returns), from the same walk: an M-mode run takes a
    layer's parameters from here where the layer's ``step_params`` is exactly that."""

    @classmethod
    def capture(cls, module: nn.Module) -> ModuleTensors:
        # This runs for every layer of every M-mode forward: list comprehensions over the
        # non-empty dicts only (extending with generators took 35 µs for a RevNet block's 15
        # modules, this 11).
        entries: list[tuple[dict[str, Any], str, Tensor | None]] = []
        norms = []
        modules = submodules(module)
        for m in modules:
            d = m._parameters
            if d:
                entries += [(d, name, t) for name, t in d.items()]
            d = m._buffers
            if d:
                entries += [(d, name, t) for name, t in d.items()]
            if isinstance(m, _NormBase) and m.training and m.track_running_stats:
                norms.append(m)
        return cls(tuple(entries), tuple(norms), no_module_draws_random_numbers(modules[1:]),
                   tuple(own_trainable_params(modules)))

    def enter(self) -> list[tuple[dict[str, Any], str, Any]]:
        """Put the recorded tensors back in the modules (usually a no-op: nothing was swapped
        since the forward) and stop the norm layers' statistics updates; returns what
        :meth:`leave` undoes. A pair of calls rather than a context manager: this runs for
        every layer of every backward."""
        swapped = []
        for d, name, t in self.entries:
            now = d.get(name)
            if now is not t:
                swapped.append((d, name, now))
                d[name] = t
        for m in self.stat_norms:
            m.__dict__["track_running_stats"] = False  # a plain attribute: skip Module.__setattr__
        return swapped

    def leave(self, swapped: list[tuple[dict[str, Any], str, Any]]) -> None:
        """Undo :meth:`enter`."""
        for m in self.stat_norms:
            m.__dict__["track_running_stats"] = True
        for d, name, now in swapped:
            d[name] = now

    @contextlib.contextmanager
    def in_place(self) -> Iterator[None]:
        """Run the body with the recorded tensors in the modules (a no-op when nothing was
        swapped since the forward, the usual case); put the current ones back afterwards."""
        swapped = [(d, name, t, d.get(name)) for d, name, t in self.entries if d.get(name) is not t]
        for d, name, t, _ in swapped:
            d[name] = t
        try:
            yield
        finally:
            for d, name, _, now in swapped:
                d[name] = now
