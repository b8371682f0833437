"""The training configuration: one typed dataclass whose field docstrings are the CLI's help.

``TrainConfig()`` is the default recipe (RevNet-38 on the bundled digits, every reversible block
in M-mode, a few minutes on two CPU cores). Every field is validated when the config is built,
so a bad value fails before any data is loaded, with a message that names the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from revtrain.errors import RevtrainError
from revtrain.planner.profile_options import ProfileOptions

__all__ = ["TrainConfig", "ConfigError", "field_docs", "SCHEDULES", "OPTIMIZERS", "DEVICES", "AMP_DTYPES",
           "PROCESS_LAYOUT", "DATA_PARALLEL_REFUSES"]

SCHEDULES = ("cosine", "step")
OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
AMP_DTYPES = ("bf16", "fp16")


class ConfigError(RevtrainError, ValueError):
    """A training option has a value that cannot work; the message says which and why."""


@dataclass(kw_only=True)
class TrainConfig(ProfileOptions):
    """Everything a training run depends on; saved in every checkpoint and in ``config.json``.
    With ``budget``, the planner measures as carefully as the inherited :class:`ProfileOptions`
    say (the options ``revtrain plan`` has too)."""

    # --- what to train
    model: str = "revnet38"
    """Model name from the registry (`revtrain models` lists them), or your own as module:factory (a module or a .py file, and the function that builds the model; docs/guide.md)."""
    dataset: str = "digits"
    """Registered dataset: digits (bundled, offline), cifar10, cifar100 (local folder), synthetic, text (bytes of local text files; default corpus: the Python standard library's sources), imagefolder (your images), imagenet32, imagenet64 (downsampled ImageNet npz batches)."""
    data_dir: str | None = None
    """CIFAR, ImageNet32/64: folder holding the files (default: $REVTRAIN_DATA_DIR or ./data). imagefolder: folder with train/<class>/ and val/<class>/. Text: a file or folder of text files, or one with enwik8 (default: the Python standard library's sources)."""
    num_workers: int = 0
    """Worker processes that build batches (0: in the training process, the fastest for in-memory data; more for imagefolder, which decodes files)."""
    image_size: int | None = None
    """Side of the input images (default: the dataset's own: digits 8, CIFAR 32); digits upsample to it."""
    augment: bool | None = None
    """Training augmentation (default: the dataset's own: on for CIFAR, off for digits)."""
    task: str | None = None
    """What the model learns: its loss and metrics (default: the task that fits the model's inputs, classification for images)."""

    # --- how long, how big
    epochs: int = 10
    """Passes over the training set."""
    batch_size: int = 64
    """Training examples per micro-batch (a step is --accumulation micro-batches)."""
    accumulation: int = 1
    """Micro-batches per optimizer step: their gradients are averaged (weighted by their samples) before each update, as one batch of accumulation x batch-size would give; batch-norm statistics update per micro-batch, the learning-rate schedule counts optimizer steps."""
    eval_batch_size: int | None = None
    """Test examples per evaluation batch (default: the training batch size)."""
    max_steps_per_epoch: int | None = None
    """Stop each epoch after this many steps (for quick checks and tests); default: whole epoch."""

    context: int | None = None
    """Text: bytes per training window (default: the model's context)."""

    # --- optimizer and schedule
    optimizer: Literal["sgd", "adamw"] = "sgd"
    """sgd (momentum, Nesterov) or adamw (betas 0.9/0.95, decoupled weight decay: the usual choice for Transformers)."""
    lr: float | None = None
    """Peak learning rate, reached at the end of the warm-up (default: 0.1; with --stages, PETRA's rule: lr-per-256 x batch-size x accumulation / 256)."""
    momentum: float = 0.9
    """SGD momentum (unused by adamw)."""
    nesterov: bool = True
    """Nesterov momentum (SGD only)."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this before each update (default: no clipping)."""
    weight_decay: float = 5e-4
    """L2 weight decay, applied to weights only: never to norm parameters or biases."""
    warmup_epochs: float = 1.0
    """Epochs of linear learning-rate warm-up from lr/steps to lr (fractions allowed)."""
    schedule: Literal["cosine", "step"] = "cosine"
    """Learning-rate decay after the warm-up, updated every step: cosine to zero, or step."""
    milestones: tuple[float, ...] = (0.5, 0.75)
    """Step schedule: fractions of the training steps at which lr is multiplied by gamma."""
    gamma: float = 0.1
    """Step schedule: factor applied to lr at each milestone."""
    divergence_factor: float = 10.0
    """Stop the run when a step's training loss exceeds this many times the run's first loss (0: no bound); a NaN or infinite loss always stops it."""

    # --- memory strategy
    mode: Literal["M", "C"] = "M"
    """Mode of every reversible block: M (rebuild inputs in backward, little memory) or C (keep them)."""
    budget: str | None = None
    """Memory budget (6GiB, 512MB, 50%): profile one batch, let the planner choose each layer's mode (M/C per reversible block; keep or recompute per other layer)."""
    choices: Literal["all", "mc"] = "all"
    """With --budget: what the planner may choose: all (M/C per reversible block and keep/recompute, on CUDA offload, per other layer) or mc (M/C only, Jiang et al.)."""
    plan: str | None = None
    """Path of a plan.json from `revtrain plan`: apply its per-block modes."""
    check_every: int | None = None
    """Check M-mode rebuilds against the forward on one step in this many (1: every step; 0: never, the fastest: a drifting rebuild then shows only in the loss); default: as the model's layers were built (the zoo's: the first 5 steps, then one in 50)."""

    # --- machine
    device: str = "auto"
    """Where to train: auto (cuda when available), cpu, cuda, or cuda:N (the GPU of index N)."""
    amp: Literal["bf16", "fp16"] | None = None
    """Mixed precision: bf16 autocast (CUDA or CPU), or fp16 autocast with a gradient scaler (CUDA)."""
    threads: int | None = None
    """CPU threads for torch ops (torch.set_num_threads; default: torch's, one per core)."""
    compile: bool = False
    """torch.compile F and G of every reversible block and the non-reversible parts (revtrain.compilation); the first steps pay the compilation."""
    seed: int = 0
    """Seed of model initialisation, data order and augmentation."""

    # --- PETRA: stage parallelism (docs/parallel.md)
    stages: int | None = None
    """PETRA: cut the model into J stages trained as a pipeline with delayed gradients (Rivaud et al. 2024), one process per stage (with --data-parallel N: J x N processes); default: no stages."""
    split: str | None = None
    """With --stages: blocks per stage (3,3,2) or the names of the blocks opening stages 2..J; default: balanced by --balance."""
    balance: Literal["time", "count"] = "time"
    """With --stages and no --split: balance the stages by measured per-unit time, or by block count."""
    engine: Literal["processes", "simulator"] = "processes"
    """With --stages: one process per stage (torch.distributed), or every stage in this process (the same arithmetic)."""
    lr_per_256: float = 0.1
    """With --stages and no --lr: the learning rate per 256 samples of a step (PETRA's rule, lr = lr-per-256 x batch-size x accumulation / 256)."""
    input_buffer: Literal["needed", "all", "none"] = "needed"
    """With --stages: inputs kept between forward and backward: needed (PETRA: only those of non-reversible units), all (every stage keeps its input and recomputes), none (refused when a stage has a non-reversible unit)."""
    stash_params: bool = False
    """With --stages: keep the parameters of each batch in flight and use them in backward (PipeDream's weight stashing; PETRA does not)."""
    track_reconstruction: bool = False
    """With --stages: keep each reversible segment's forward input to report how far its rebuild drifted (a diagnostic that costs the memory PETRA saves)."""
    dropout_seed: int = 0
    """With --stages: batch b of epoch e on stage s draws its dropout from a stream derived from (dropout_seed, e, b, s)."""

    # --- processes: data parallelism and how a run on several processes starts (docs/parallel.md)
    data_parallel: int | None = None
    """DDP: train on N local processes, each on 1/N of every batch (same updates as one process on the whole batch); with --stages J, N replicas of every stage (J x N processes on a (pp, dp) device mesh). Not taken from a resumed run: a data-parallel run may resume with another N, or in one process."""
    shard: bool = False
    """With --data-parallel: shard parameters, gradients and optimizer state over the processes (FSDP2)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """With several processes: the torch.distributed backend; auto picks nccl on CUDA and gloo on CPU."""
    port: int = 0
    """With several processes: the rendezvous port of the local processes (0: a free one)."""
    timeout: float = 60.0
    """With several processes: seconds a process waits for another before the run is ended as failed."""

    # --- outputs
    run_dir: str | None = None
    """Folder for metrics, checkpoints and the summary (default: runs/<model>-<dataset>-<time>)."""
    resume: str | None = None
    """Continue a run: its checkpoint.pt, its folder, or 'auto' for the latest run of this model and dataset (with --run-dir: that run)."""
    overwrite: bool = False
    """Start a new run in --run-dir even though the folder is not empty: its run files (metrics, checkpoints, summary, logs) are replaced. Without it a new run refuses any folder with files in it."""
    checkpoint_every: int = 0
    """Also save a checkpoint every this many steps (0: at the end of each epoch only)."""
    log_every: int = 1
    """Write a step record to metrics.jsonl (and steps.csv) every this many steps."""
    tensorboard: bool = False
    """Also write TensorBoard event files into <run>/tensorboard/ (needs pip install 'revtrain[tensorboard]')."""
    keep_checkpoints: int = 0
    """Also keep the checkpoints of the last K evaluated epochs (checkpoints/step-<step>.pt) and of the best one by the test metric (checkpoints/best.pt); 0: only checkpoint.pt, the latest."""
    grad_angle_every: int = 0
    """Every this many steps, measure on that step's batch the angle and relative error between gradients with stored (C-mode) and rebuilt (M-mode) activations per parameter group (RevNet §5.2): metrics.jsonl records and grad_angles.png in the run folder; training is unchanged (0: off)."""
    memory_report: bool = True
    """After training, measure one step's peak memory in the run's modes and with plain backprop."""
    quiet: bool = False
    """No progress bar; still print one line per epoch and the summary."""

    def __post_init__(self) -> None:
        _all_finite(self)
        try:
            self.check_profile_options()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        _at_least(self, "epochs", 1)
        _at_least(self, "batch_size", 1)
        _at_least(self, "accumulation", 1)
        _at_least(self, "checkpoint_every", 0)
        _at_least(self, "log_every", 1)
        _at_least(self, "num_workers", 0)
        _at_least(self, "keep_checkpoints", 0)
        _at_least(self, "grad_angle_every", 0)
        if self.eval_batch_size is not None:
            _at_least(self, "eval_batch_size", 1)
        if self.max_steps_per_epoch is not None:
            _at_least(self, "max_steps_per_epoch", 1)
        if self.threads is not None:
            _at_least(self, "threads", 1)
        if self.check_every is not None:
            _at_least(self, "check_every", 0)
        if self.image_size is not None:
            _at_least(self, "image_size", 1)
        if self.context is not None:
            _at_least(self, "context", 1)
        _choice(self, "optimizer", OPTIMIZERS)
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"grad_clip (--grad-clip) must be positive, got {self.grad_clip}; leave it out "
                              "for no clipping")
        if not self.lr_per_256 > 0:
            raise ConfigError(f"lr_per_256 must be positive, got {self.lr_per_256}")
        if self.lr is None:  # the recipe's default, or PETRA's rule: config.json records the value
            self.lr = 0.1 if self.stages is None else self.lr_per_256 * self.batch_size * self.accumulation / 256
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.optimizer == "sgd" and self.nesterov and self.momentum == 0:
            raise ConfigError("Nesterov momentum needs momentum > 0; set --momentum or pass --no-nesterov")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_epochs < 0:
            raise ConfigError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        _choice(self, "schedule", SCHEDULES)
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N (N the GPU's index); got {self.device!r}")
        if self.amp is not None:
            _choice(self, "amp", AMP_DTYPES)
        self.milestones = tuple(float(m) for m in self.milestones)
        if any(not 0 < m < 1 for m in self.milestones) or list(self.milestones) != sorted(self.milestones):
            raise ConfigError(
                f"milestones must be increasing fractions of training in (0, 1), got {self.milestones}"
            )
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.divergence_factor != 0 and not self.divergence_factor > 1:
            raise ConfigError(f"divergence_factor must be 0 (no bound) or above 1, got {self.divergence_factor}")
        if self.task is not None and not str(self.task).strip():
            raise ConfigError("task is empty; leave it unset to use the model's task, or name one")
        if not isinstance(self.mode, str) or self.mode.upper() not in ("M", "C"):
            raise ConfigError(f"mode must be 'M' or 'C', got {self.mode!r}")
        self.mode = self.mode.upper()  # type: ignore[assignment]
        if self.budget is not None and self.plan is not None:
            raise ConfigError("give either --budget (plan now) or --plan (load a plan), not both")
        if self.mode != "M" and (self.budget is not None or self.plan is not None):
            source = "--budget" if self.budget is not None else "--plan"
            raise ConfigError(f"--mode {self.mode} with {source}: the plan sets each block's mode; drop --mode")
        if self.budget is not None and not str(self.budget).strip():
            raise ConfigError("budget is empty; give a size such as 6GiB, or a fraction such as 50%")
        self._check_stages()
        self._check_processes()

    def _check_stages(self) -> None:
        """PETRA's options: only with --stages, and the run options its stages cannot honour refused."""
        if self.stages is None:
            petra = [name for name, default in _PETRA_DEFAULTS.items() if getattr(self, name) != default]
            if petra:
                raise ConfigError(f"{', '.join('--' + _flag(n) for n in petra)}: PETRA options; add --stages J")
            return
        _at_least(self, "stages", 1, flag=True)
        _choice(self, "balance", ("time", "count"))
        _choice(self, "engine", ("processes", "simulator"))
        _choice(self, "input_buffer", ("needed", "all", "none"))
        refused = [(name, why) for name, (ok, why) in _PETRA_REFUSES.items() if getattr(self, name) not in ok]
        if refused:
            reasons = "; ".join(f"--{_flag(name)}: {why}" for name, why in refused)
            raise ConfigError(f"not available with --stages (PETRA): {reasons}. Drop them, or train without --stages")

    def _check_processes(self) -> None:
        """The options of a run on several processes: only with one, and what it cannot honour refused."""
        n = self.data_parallel
        if n is not None:
            _at_least(self, "data_parallel", 1, flag=True)
        _choice(self, "backend", ("auto", "gloo", "nccl"))
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port (--port) must be an integer in [0, 65535], got {self.port!r}; 0 picks a free one")
        if not self.timeout > 0:
            raise ConfigError(f"timeout (--timeout) must be > 0 seconds, got {self.timeout}")
        if self.shard and n is None:
            raise ConfigError("--shard shards over data-parallel processes; add --data-parallel N")
        processes = n is not None or (self.stages is not None and self.engine == "processes")
        if not processes:
            given = [name for name, default in _PROCESS_DEFAULTS.items() if getattr(self, name) != default]
            if given:
                raise ConfigError(f"{', '.join('--' + _flag(n) for n in given)}: options of a run on several "
                                  "processes; add --data-parallel N (or --stages J), or drop them")
            return
        if ":" in self.device:
            raise ConfigError(f"--device {self.device} names one GPU, and each process of --stages/--data-parallel "
                              "takes the GPU of its local rank; pass --device cuda")
        if n is None:
            return
        for name, (ok, why) in DATA_PARALLEL_REFUSES.items():
            if getattr(self, name) not in ok:
                raise ConfigError(f"--{_flag(name)} is not available with --data-parallel: {why}")
        if self.stages is None:
            return
        if self.shard:
            raise ConfigError("--shard with --stages: the replicas of a PETRA stage all-reduce their gradients, "
                              "they do not shard them; drop --shard")
        if self.engine == "simulator":
            raise ConfigError("--engine simulator runs one replica of every stage; drop --data-parallel or use "
                              "--engine processes")
        if self.batch_size % n:
            raise ConfigError(f"--batch-size {self.batch_size} cannot be cut into {n} equal replica slices; use a "
                              f"multiple of {n}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable data (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys (from another revtrain version) raise ``ConfigError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown training option(s) {', '.join(unknown)}; the config was probably written "
                "by another revtrain version"
            )
        values = dict(data)
        if "milestones" in values:
            values["milestones"] = tuple(values["milestones"])
        return cls(**values)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_PETRA_DEFAULTS = {"split": None, "engine": "processes", "lr_per_256": 0.1, "input_buffer": "needed",
                   "stash_params": False, "track_reconstruction": False}
"""PETRA's options (their defaults): given without --stages they are refused."""

_PETRA_REFUSES = {
    "optimizer": (("sgd",), "PETRA uses SGD with Nesterov momentum"),
    "grad_clip": ((None,), "PETRA's stages update separately, so there is no global gradient norm"),
    "mode": (("M",), "PETRA's stages rebuild reversible blocks themselves, whatever their mode"),
    "budget": ((None,), "PETRA's stages keep no activations of reversible blocks"),
    "plan": ((None,), "PETRA's stages keep no activations of reversible blocks"),
    "amp": ((None,), "PETRA runs in the model's dtype"),
    "compile": ((False,), "PETRA runs its stages eagerly"),
    "context": ((None,), "PETRA trains image classifiers"),
    "keep_checkpoints": ((0,), "a PETRA checkpoint refers to per-stage files that only the latest keeps"),
    "grad_angle_every": ((0,), "PETRA's rebuilds use moved parameters by design; --track-reconstruction reports their drift"),
    "check_every": ((None,), "PETRA's rebuilds use moved parameters by design; --track-reconstruction reports their drift"),
}
"""Run options a --stages run cannot honour: (the values it accepts, why)."""

_PROCESS_DEFAULTS = {"backend": "auto", "port": 0, "timeout": 60.0}
"""How the processes of a run start (their defaults): given for a run in one process they are refused."""

DATA_PARALLEL_REFUSES = {
    "budget": ((None,), "planning profiles one process; plan first with `revtrain plan` and pass --mode, or train "
                        "without --data-parallel"),
    "plan": ((None,), "pass the plan's mode with --mode, or train without --data-parallel"),
    "grad_angle_every": ((0,), "the monitor measures one process's step; run it without --data-parallel"),
}
"""Run options a --data-parallel run cannot honour: (the values it accepts, why)."""

PROCESS_LAYOUT = ("engine", "data_parallel", "shard", "backend", "port", "timeout")
"""How a run is spread over processes: each command says it (a resumed run does not inherit it)."""


def _flag(name: str) -> str:
    return name.replace("_", "-")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and of the dataclasses it inherits from, read
    from their source (the CLI's help).

    Fields without a docstring are missing from the result.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _all_finite(config: TrainConfig) -> None:
    """Refuse NaN and infinity in every float option (``--lr inf`` passes ``lr > 0``)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{f.name} (--{f.name.replace('_', '-')}) must be a finite number, got "
                              f"{_show(value)}; NaN and infinity cannot train")


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _at_least(config: TrainConfig, name: str, low: int, *, flag: bool = False) -> None:
    """Refuse a value below ``low``; ``flag``: the message names the option's flag too."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = f"{name} (--{_flag(name)})" if flag else name
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}")


def _choice(config: TrainConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")

