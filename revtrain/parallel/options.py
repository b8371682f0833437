"""The options of a PETRA training run (``python -m revtrain.parallel``), one typed dataclass.

Algorithm options (accumulation, learning-rate rule, buffers) are in
:class:`~revtrain.parallel.config.PetraConfig`; this one says what to train, for how long, on
which engine and where to write. Both are validated when built and their field docstrings are
the command line's help.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from revtrain.parallel.errors import PipelineConfigError

__all__ = ["RunOptions", "Engine", "parse_split"]

Engine = Literal["processes", "simulator"]


@dataclass(kw_only=True)
class RunOptions:
    """What a PETRA run trains, how long, on which engine, and where it writes."""

    model: str = "revnet38"
    """Model name from the registry (`revtrain models`)."""
    dataset: str = "digits"
    """Dataset: digits (bundled, offline), cifar10, cifar100 (local folder) or synthetic."""
    data_dir: str | None = None
    """Folder holding the extracted CIFAR batches."""
    image_size: int | None = None
    """Side of the input images (default: the dataset's own); digits upsample to it."""
    stages: int = 2
    """J: stages (one worker process each with --engine processes; with torchrun, the world size)."""
    split: str | None = None
    """Blocks per stage (3,3,2) or the names of the blocks opening stages 2..J; default: balanced by measured time."""
    replicas: int = 1
    """N: data-parallel replicas of every stage (J x N processes); each replica's pipeline takes 1/N of every batch."""
    balance: Literal["time", "count"] = "time"
    """Without --split: balance the stages by measured per-unit time, or give each the same number of blocks."""
    engine: Engine = "processes"
    """processes: one OS process per stage on torch.distributed; simulator: all stages in this process (same arithmetic)."""
    epochs: int = 10
    """Passes over the training set."""
    batch_size: int = 64
    """Samples per mini-batch (the last partial batch of an epoch is dropped, so every message has one shape)."""
    eval_batch_size: int | None = None
    """Samples per evaluation batch (default: batch_size)."""
    max_batches: int | None = None
    """Train on at most this many batches per epoch (quick checks)."""
    warmup_epochs: float = 1.0
    """Epochs of linear learning-rate warm-up (the paper: 5 of 300)."""
    schedule: Literal["cosine", "step"] = "cosine"
    """Decay after the warm-up, per parameter update: cosine to zero, or step by gamma at milestones."""
    milestones: tuple[float, ...] = (0.5, 0.75)
    """Step schedule: fractions of the run at which the learning rate is multiplied by gamma."""
    gamma: float = 0.1
    """Step schedule: the factor at each milestone."""
    dtype: Literal["float32", "float64"] = "float32"
    """Parameter and activation dtype."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """cpu, or cuda (each process takes the GPU of its local rank), or auto."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto picks nccl on CUDA and gloo on CPU."""
    threads: int = 1
    """CPU threads per stage process (torch.set_num_threads); the simulator uses them too."""
    port: int = 0
    """Rendezvous port of the local launcher (0: a free one)."""
    timeout: float = 60.0
    """Seconds a stage waits for a neighbour before the run is ended as failed."""
    seed: int = 0
    """Seed of the model's initialisation and the data order."""
    run_dir: str | None = None
    """Folder for metrics.jsonl, checkpoints and summary.json (default: runs/petra-<model>-<dataset>-J<stages>-<time>)."""
    resume: bool = False
    """Continue the run in --run-dir from its last complete checkpoint."""
    quiet: bool = False
    """Print only the summary."""

    def __post_init__(self) -> None:
        for name, low in (("stages", 1), ("replicas", 1), ("epochs", 1), ("batch_size", 1), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PipelineConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_batches is not None and self.max_batches < 1:
            raise PipelineConfigError(f"max_batches must be >= 1, got {self.max_batches}")
        if not 0 <= self.port < 65536:
            raise PipelineConfigError(f"port must be in [0, 65535], got {self.port}")
        if not self.timeout > 0:
            raise PipelineConfigError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.engine not in ("processes", "simulator"):
            raise PipelineConfigError(f"engine must be 'processes' or 'simulator', got {self.engine!r}")
        if self.batch_size % self.replicas:
            raise PipelineConfigError(
                f"batch_size {self.batch_size} does not split into {self.replicas} equal slices, one per replica; "
                f"use a multiple of {self.replicas}"
            )
        if self.resume and not self.run_dir:
            raise PipelineConfigError("resume needs --run-dir: the folder of the run to continue")
        parse_split(self.split)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_split(text: str | None) -> list[int] | list[str] | None:
    """``"3,3,2"`` -> ``[3, 3, 2]``; ``"stages.1.transition,..."`` -> names; None -> None."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise PipelineConfigError(f"split {text!r} is empty; give counts (3,3,2) or block names")
    if all(p.lstrip("-").isdigit() for p in parts):
        return [int(p) for p in parts]
    if any(p.lstrip("-").isdigit() for p in parts):
        raise PipelineConfigError(f"split {text!r} mixes counts and names; give one or the other")
    return parts
