"""Stage-parallel training of reversible networks (PETRA) and data parallelism.

PETRA (Rivaud et al. 2024) cuts a network into J stages, one per worker; at every tick each
stage runs the forward of a new mini-batch and the backward of an older one. Reversible stages
keep no input and no stashed weights: their backward rebuilds the input from the output with
the current parameters (:func:`revtrain.core.reverse_step`). See ``docs/parallel.md``.

- :func:`split_model` — J contiguous stages at block boundaries (balanced or explicit).
- :class:`StageWorker` — one stage's forward, backward, accumulation and buffers.
- :class:`Simulator` — every stage in one process (the oracle).
- :class:`DistributedPipeline` — one process per stage on ``torch.distributed``.
- :class:`PetraEngine` — PETRA as an engine of the one :class:`~revtrain.train.Trainer`
  (``revtrain train --stages J``).
- :mod:`revtrain.parallel.data_parallel` — DDP and FSDP2 for reversible models.
"""

from revtrain.parallel.config import PetraConfig
from revtrain.parallel.distributed import DistributedPipeline
from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.parallel.partition import Stage, split_model, stage_shapes
from revtrain.parallel.petra_engine import PetraEngine
from revtrain.parallel.simulator import EpochResult, Simulator
from revtrain.parallel.units import Unit, model_units
from revtrain.parallel.worker import StageWorker

__all__ = [
    "DistributedPipeline",
    "EpochResult",
    "PetraConfig",
    "PipelineConfigError",
    "PetraEngine",
    "Simulator",
    "Stage",
    "StageFailedError",
    "StageWorker",
    "Unit",
    "model_units",
    "split_model",
    "stage_shapes",
]
