"""State that a rebuild in backward must reproduce or leave alone.

Four things can differ between running ``F`` in the forward pass and running it again in
backward; three are handled here:

- random numbers (dropout): :class:`RngState` captures the generators before ``F`` runs and
  replays them around the rebuild, then puts the generators back as they were (only where
  ``F`` moved them: a function without randomness has nothing to replay);
- autocast: :class:`AutocastState` records the forward's autocast settings and re-enters them;
- batch-norm running statistics: :func:`no_running_stat_updates` keeps the rebuild from
  updating them a second time, without writing to them;
- the parameters and buffers themselves (``torch.func.functional_call``): ``functional_call.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase


__all__ = ["RngState", "AutocastState", "autocast_device_type", "no_running_stat_updates", "stat_norms"]


@dataclass(slots=True)
class RngState:
    """The CPU generator's state tensor and, for a CUDA device, its (Philox) generator's seed and
    offset: two integers that are its whole state, read and compared without making a tensor."""

    cpu: Tensor
    cuda: torch.Generator | None = None
    cuda_seed_offset: tuple[int, int] | None = None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            gen = torch.cuda.default_generators[index]
            return cls(torch.default_generator.get_state(), gen, (gen.initial_seed(), gen.get_offset()))
        return cls(torch.default_generator.get_state())

    def same_as(self, other: RngState) -> bool:
        """Whether the generators are in the same state (nothing drew random numbers between
        the two captures)."""
        return self.cuda_seed_offset == other.cuda_seed_offset and torch.equal(self.cpu, other.cpu)

    @classmethod
    def around(cls, device: torch.device, fn: Any, *args: Any) -> tuple[Any, RngState | None]:
        """``fn(*args)`` and the generator state it started from, or None when it drew no
        random numbers (a rebuild then has nothing to replay)."""
        before = cls.capture(device)
        out = fn(*args)
        return out, None if before.same_as(cls.capture(device)) else before

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured generators; restore the current ones afterwards."""
        cpu_now = torch.get_rng_state()
        gen = self.cuda
        cuda_now = (gen.initial_seed(), gen.get_offset()) if gen is not None else None
        torch.set_rng_state(self.cpu)
        if gen is not None:
            _set_seed_offset(gen, self.cuda_seed_offset)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            if gen is not None:
                _set_seed_offset(gen, cuda_now)


def _set_seed_offset(gen: torch.Generator, seed_offset: Any) -> None:
    """What ``gen.set_state`` does with a Philox state: the seed, then the offset."""
    gen.manual_seed(seed_offset[0])
    gen.set_offset(seed_offset[1])


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


def stat_norms(modules: Iterable[nn.Module]) -> list[_NormBase]:
    """The norm layers among ``modules`` (not their submodules) that would update statistics."""
    return [m for m in modules if isinstance(m, _NormBase) and m.training and m.track_running_stats]


@contextlib.contextmanager
def no_running_stat_updates(*modules: nn.Module) -> Iterator[None]:
    """Run the body without updating the running statistics of norm layers in ``modules``.

    The layers are told not to track them for the duration (``track_running_stats = False`` in
    training mode: batch statistics, no update), so no tensor is written to: other pending
    graphs that saved the statistics stay valid.
    """
    with no_running_stat_updates_of(stat_norms(m for module in modules for m in module.modules())):
        yield


@contextlib.contextmanager
def no_running_stat_updates_of(norms: Iterable[_NormBase]) -> Iterator[None]:
    """:func:`no_running_stat_updates` for norm layers already found."""
    norms = list(norms)
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True
