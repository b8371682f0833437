"""In-memory datasets and a deterministic, resumable batch loader.

Every dataset revtrain ships fits in memory (digits: 1.8k images, CIFAR: 60k uint8 images,
150 MiB), so a dataset is two tensors and a :class:`~revtrain.data.transforms.BatchTransform`,
and a batch is made with one indexing op and vectorised augmentation instead of per-sample
Python calls.

Determinism and resume. :class:`ResumableLoader` derives all its randomness from the seed:

* the order of epoch ``e`` is ``randperm`` under a generator seeded from ``(seed, e)``;
* the augmentation of batch ``b`` of epoch ``e`` uses a generator seeded from ``(seed, e, b)``.

So batch ``b`` of epoch ``e`` is the same tensor whether the loader got there by iterating
from the start, after a restart, or in a worker process, and resuming costs nothing: the
loader's whole state is ``{"epoch", "next_batch"}``.

How the trainer uses it::

    train_loader.load_state_dict(ckpt["train_loader"])   # only when resuming
    while train_loader.epoch < epochs:
        epoch = train_loader.epoch
        for x, y in train_loader:                      # batches next_batch .. len-1
            step(x, y)
            if should_checkpoint():
                save({"train_loader": train_loader.state_dict(), ...})
        evaluate(epoch)                                 # the epoch advanced by itself

A full pass moves the loader to ``(epoch + 1, 0)``; breaking out of the loop keeps the
position, so the next ``for`` continues the same epoch. ``set_epoch(e)`` jumps to the start
of epoch ``e`` (the :class:`~torch.utils.data.DistributedSampler` convention) for callers
who prefer to drive the epoch themselves; do not call it after ``load_state_dict`` or the
position inside the epoch is lost.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from revtrain.data.errors import DatasetError
from revtrain.data.transforms import BatchTransform

__all__ = ["DatasetInfo", "InMemoryDataset", "DatasetSplits", "ResumableLoader", "derive_seed"]

# Independent random streams derived from one user seed.
_STREAM_ORDER = 1
_STREAM_AUGMENT = 2


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for ``torch.Generator.manual_seed``, mixed from ``seed`` and ``keys``.

    Uses :class:`numpy.random.SeedSequence`, so nearby inputs such as ``(0, 1)`` and ``(1, 0)``
    give unrelated streams, and the result is the same on every platform.
    """
    words = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return int((int(words[0]) << 31) ^ int(words[1]))


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """What a model and a trainer need to know about a dataset."""

    name: str
    """Registry name: ``"digits"``, ``"cifar10"``, ``"cifar100"`` or ``"synthetic"``."""
    input_shape: tuple[int, ...]
    """Shape of one input as the model receives it, e.g. ``(3, 32, 32)``."""
    num_classes: int
    """Number of target classes; targets are ``0 .. num_classes - 1``."""
    train_size: int
    """Number of training examples."""
    test_size: int
    """Number of test examples."""
    mean: tuple[float, ...] | None = None
    """Per-channel mean used for normalisation, if any."""
    std: tuple[float, ...] | None = None
    """Per-channel standard deviation used for normalisation, if any."""
    class_names: tuple[str, ...] | None = None
    """Human-readable class names when the dataset provides them."""

    @property
    def in_channels(self) -> int:
        """Channels of an image (the first entry of ``input_shape``)."""
        return self.input_shape[0]

    @property
    def image_size(self) -> int | None:
        """Side of a square image, or ``None`` for inputs that are not square images."""
        if len(self.input_shape) == 3 and self.input_shape[1] == self.input_shape[2]:
            return self.input_shape[1]
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for metrics files and checkpoints (JSON-serialisable)."""
        out = asdict(self)
        out.update(in_channels=self.in_channels, image_size=self.image_size)
        return out


class InMemoryDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Stored inputs, integer targets and the transform that turns inputs into network inputs.

    Args:
        inputs: Stored examples, shape ``(N, *input_shape)``, any dtype the transform accepts
            (uint8 for CIFAR keeps it at 150 MiB).
        targets: Class indices, shape ``(N,)``; converted to int64.
        transform: Applied per batch by :meth:`get_batch`.
    """

    def __init__(
        self, inputs: torch.Tensor, targets: torch.Tensor, transform: BatchTransform | None = None
    ) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"{inputs.shape[0]} inputs but {targets.shape[0]} targets")
        self.inputs = inputs
        self.targets = targets.to(torch.int64)
        self.transform = transform if transform is not None else BatchTransform()

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One example without augmentation (for inspection; training uses :meth:`get_batch`)."""
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]

    def get_batch(
        self, indices: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather and transform the examples at ``indices``; returns ``(inputs, targets)``."""
        return self.transform(self.inputs[indices], generator), self.targets[indices]

    def with_transform(self, transform: BatchTransform) -> InMemoryDataset:
        """The same stored tensors (not copied) under another transform."""
        return InMemoryDataset(self.inputs, self.targets, transform)


@dataclass(frozen=True)
class DatasetSplits:
    """A dataset's train and test splits and their :class:`DatasetInfo`."""

    train: InMemoryDataset
    test: InMemoryDataset
    info: DatasetInfo


class _BatchFetcher(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map a batch key ``(epoch, batch_index, indices)`` to a batch; runs in workers too."""

    def __init__(self, dataset: InMemoryDataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __getitem__(self, key: tuple[int, int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, batch, indices = key
        gen = None
        if self.dataset.transform.is_random:
            gen = _generator(derive_seed(self.seed, _STREAM_AUGMENT, epoch, batch))
        return self.dataset.get_batch(indices, gen)


_TRACEBACK_HEADER = "Traceback (most recent call last):\n"


def _unwrap_worker_error(err: DatasetError) -> DatasetError | None:
    """The error a DataLoader worker raised, as it was raised, or None if ``err`` is not one.

    torch re-raises a worker's exception in the main process as the same type, built from one
    message: a line ``Caught <Type> in DataLoader worker process <i>.``, then ``Original`` and
    the worker's traceback, which ends with ``<module>.<Type>: <message>``. The message is
    everything after that ``<module>.<Type>: ``, so a message of several lines comes back whole.
    """
    text = str(err.args[0]) if len(err.args) == 1 else ""
    first, _, rest = text.partition("\n")
    if not (first.startswith("Caught ") and " in DataLoader worker process " in first):
        return None
    cls = type(err)
    name = cls.__qualname__ if cls.__module__ in ("builtins", "__main__") else f"{cls.__module__}.{cls.__qualname__}"
    at = rest.rfind(_TRACEBACK_HEADER)
    if at < 0:
        return None
    # After the header come the frames (indented lines), then the exception's own line(s).
    lines = rest[at + len(_TRACEBACK_HEADER):].split("\n")
    while lines and lines[0].startswith((" ", "\t")):
        lines.pop(0)
    tail = "\n".join(lines).rstrip("\n")
    if tail == name:
        message = ""
    elif tail.startswith(name + ": "):
        message = tail[len(name) + 2:]
    else:
        return None
    try:
        return cls(message)
    except Exception:  # a subclass that is not built from one message: keep torch's error
        return None


class ResumableLoader:
    """Batches of an :class:`InMemoryDataset` that any checkpoint can resume exactly.

    See the module docstring for the determinism contract and the trainer loop.

    Args:
        dataset: The examples and their transform.
        batch_size: Examples per batch.
        shuffle: Shuffle each epoch (training) or keep the stored order (evaluation).
        seed: Root of every random choice the loader makes.
        drop_last: Drop the last batch when it is smaller than ``batch_size``.
        num_workers: Worker processes that build batches. 0 (the default) builds them in the
            calling process, which is fastest for in-memory data on a few cores.
        pin_memory: Return batches in pinned memory, for faster copies to a GPU.
    """

    def __init__(
        self,
        dataset: InMemoryDataset,
        *,
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"drop_last with batch_size={batch_size} leaves no batch of a dataset of "
                f"{len(dataset)} examples; lower batch_size or set drop_last=False"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.epoch = 0
        """Epoch the next batch belongs to."""
        self.next_batch = 0
        """Index, within :attr:`epoch`, of the next batch to be yielded."""

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The example indices of ``epoch`` in the order they are served (a pure function)."""
        n = len(self.dataset)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=_generator(derive_seed(self.seed, _STREAM_ORDER, epoch)))

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Move to batch ``start_batch`` of ``epoch``; the next iteration starts there."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}], got {start_batch}")
        self.epoch, self.next_batch = epoch, start_batch
        if start_batch == len(self):
            self.epoch, self.next_batch = epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, plus what must match on resume."""
        return {
            "epoch": self.epoch,
            "next_batch": self.next_batch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at the position saved by :meth:`state_dict`.

        Raises:
            ValueError: The state was saved with another seed, batch size or dataset size,
                so the same position would not give the same batches.
        """
        for key, mine in (
            ("seed", self.seed),
            ("batch_size", self.batch_size),
            ("dataset_size", len(self.dataset)),
        ):
            if key in state and state[key] != mine:
                what = (f"the run's data had {state[key]} samples and this data has {mine} (another --data-dir, "
                        "or files added or removed?)" if key == "dataset_size" else
                        f"loader state was saved with {key}={state[key]} but this loader has {key}={mine}")
                raise ValueError(f"{what}; resume with the data and settings the run was trained with")
        self.set_epoch(int(state["epoch"]), int(state["next_batch"]))

    def _keys(self, epoch: int, start: int) -> list[tuple[int, int, torch.Tensor]]:
        order = self.epoch_order(epoch)
        stop = len(self)
        return [
            (epoch, b, order[b * self.batch_size : (b + 1) * self.batch_size]) for b in range(start, stop)
        ]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(inputs, targets)`` from :attr:`next_batch` to the end of :attr:`epoch`."""
        epoch = self.epoch
        keys = self._keys(epoch, self.next_batch)
        fetcher = _BatchFetcher(self.dataset, self.seed)
        batches: Any
        if self.num_workers > 0:
            batches = DataLoader(
                fetcher,  # type: ignore[arg-type]
                sampler=keys,  # type: ignore[arg-type]
                batch_size=None,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
            )
        else:
            batches = (self._pin(fetcher[key]) for key in keys)
        drawn = iter(batches)
        while True:
            try:
                x, y = next(drawn)
            except StopIteration:
                break
            except DatasetError as err:
                original = _unwrap_worker_error(err)
                if original is None:
                    raise
                # The worker's traceback, in torch's message, stays reachable as the cause. Without
                # its main-process frames (torch's re-raise) and ``drawn``, nothing holds the
                # DataLoader's iterator, so its workers shut down now, not when the error is freed.
                del drawn
                raise original from err.with_traceback(None)
            # Count the batch as consumed when handed out: a checkpoint taken while the
            # caller trains on it resumes with the one after.
            self.next_batch += 1
            yield x, y
        if self.epoch == epoch and self.next_batch >= len(self):
            self.epoch, self.next_batch = epoch + 1, 0

    def _pin(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pin_memory and torch.cuda.is_available():
            return batch[0].pin_memory(), batch[1].pin_memory()
        return batch

    def __repr__(self) -> str:
        return (
            f"ResumableLoader(n={len(self.dataset)}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, epoch={self.epoch}, next_batch={self.next_batch})"
        )
