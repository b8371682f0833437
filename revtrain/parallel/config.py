"""What a PETRA stage worker needs: accumulation, learning rate, SGD settings, buffers.

One typed dataclass, validated when built. A training run fills it from its
:class:`~revtrain.train.TrainConfig` (where ``revtrain train --stages`` takes these options);
the simulator, the multi-process pipeline and the benchmarks build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from revtrain.parallel.errors import PipelineConfigError

__all__ = ["PetraConfig", "InputBuffer"]

InputBuffer = Literal["needed", "all", "none"]


@dataclass(kw_only=True)
class PetraConfig:
    """How every PETRA stage computes and applies its delayed gradients (Rivaud et al. 2024)."""

    accumulation: int = 1
    """k: backward passes whose gradients are averaged before each parameter update."""
    lr: float | None = None
    """Peak learning rate; default: the paper's rule lr_per_256 * batch_size * k / 256 (0.1*64k/256 at batch 64)."""
    lr_per_256: float = 0.1
    """Learning rate per 256 samples of effective batch (batch_size * k), used when lr is not given."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = True
    """Nesterov momentum, as in the paper."""
    weight_decay: float = 5e-4
    """L2 weight decay on convolution and linear weights; never on norm parameters or biases."""
    input_buffer: InputBuffer = "needed"
    """Inputs kept between forward and backward: needed (PETRA: only the inputs of non-reversible units), all (every stage keeps its input and recomputes, as delayed-gradient methods do), none (refused when a stage has a non-reversible unit)."""
    stash_params: bool = False
    """Keep a copy of the parameters of each batch in flight and use it in backward (PipeDream's weight stashing; PETRA does not: it uses the current parameters)."""
    track_reconstruction: bool = False
    """Diagnostic: keep each reversible segment's forward input to report how far its rebuild drifted (costs the memory PETRA saves)."""
    dropout_seed: int = 0
    """Seeds dropout: batch b of epoch e on stage s draws from a stream derived from (dropout_seed, e, b, s)."""

    def __post_init__(self) -> None:
        if isinstance(self.accumulation, bool) or not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise PipelineConfigError(
                f"accumulation (k) must be an integer >= 1, got {self.accumulation!r}; k=1 updates "
                "after every backward"
            )
        if self.lr is not None and not self.lr > 0:
            raise PipelineConfigError(f"lr must be > 0, got {self.lr}")
        if not self.lr_per_256 > 0:
            raise PipelineConfigError(f"lr_per_256 must be > 0, got {self.lr_per_256}")
        if not 0 <= self.momentum < 1:
            raise PipelineConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise PipelineConfigError("Nesterov momentum needs momentum > 0; set --no-nesterov or a momentum")
        if self.weight_decay < 0:
            raise PipelineConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.input_buffer not in ("needed", "all", "none"):
            raise PipelineConfigError(
                f"input_buffer must be 'needed', 'all' or 'none', got {self.input_buffer!r}"
            )

    def peak_lr(self, batch_size: int) -> float:
        """The learning rate at the end of the warm-up for mini-batches of ``batch_size``."""
        if self.lr is not None:
            return self.lr
        return self.lr_per_256 * batch_size * self.accumulation / 256
