"""Seeded synthetic classification data of any input shape, for benchmarks and tests.

Each class has a fixed random prototype; an example is its class prototype plus Gaussian
noise, ``x = prototype[y] + noise * N(0, 1)``. The task is learnable (so a training run on it
shows a falling loss) and costs no disk or download. Train and test examples are drawn
independently from the same prototypes. All of it is held in memory:
``(train_size + test_size) * prod(input_shape) * 4`` bytes.
"""

from __future__ import annotations

import torch

from revtrain.data.loader import DatasetInfo, DatasetSplits, InMemoryDataset, derive_seed

__all__ = ["make_synthetic", "build_synthetic"]

_STREAM_PROTOTYPES = 11
_STREAM_DRAWS = 12  # + split index


def _generator(seed: int, stream: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, stream))
    return gen


def make_synthetic(
    num_examples: int,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    seed: int = 0,
    noise: float = 1.0,
    split: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``num_examples`` examples; classes are balanced (counts differ by at most one).

    Args:
        num_examples: How many examples to draw.
        input_shape: Shape of one example, e.g. ``(3, 32, 32)`` or ``(64,)``.
        num_classes: Number of classes (prototypes).
        seed: Fixes the prototypes and the draws.
        noise: Standard deviation of the noise around each prototype (whose entries are N(0, 1)).
        split: Stream index; different splits share prototypes but not draws.

    Returns:
        ``(inputs, targets)``: float32 ``(num_examples, *input_shape)`` and int64 ``(num_examples,)``.
    """
    if num_examples < 1 or num_classes < 1:
        raise ValueError(f"need num_examples >= 1 and num_classes >= 1, got {num_examples}, {num_classes}")
    if not input_shape or any(d < 1 for d in input_shape):
        raise ValueError(f"input_shape must be a non-empty tuple of positive sizes, got {input_shape}")
    prototypes = torch.randn(num_classes, *input_shape, generator=_generator(seed, _STREAM_PROTOTYPES))
    gen = _generator(seed, _STREAM_DRAWS + split)
    targets = (torch.arange(num_examples) % num_classes)[torch.randperm(num_examples, generator=gen)]
    inputs = prototypes[targets] + noise * torch.randn(num_examples, *input_shape, generator=gen)
    return inputs, targets


def build_synthetic(
    *,
    input_shape: tuple[int, ...] = (3, 32, 32),
    num_classes: int = 10,
    train_size: int = 1024,
    test_size: int = 256,
    seed: int = 0,
    noise: float = 1.0,
) -> DatasetSplits:
    """Train and test splits of synthetic data; no augmentation, no normalisation.

    Args:
        input_shape: Shape of one example.
        num_classes: Number of classes.
        train_size: Training examples.
        test_size: Test examples.
        seed: Fixes the whole dataset.
        noise: Standard deviation of the noise around the class prototypes.
    """
    input_shape = tuple(int(d) for d in input_shape)
    train_x, train_y = make_synthetic(train_size, input_shape, num_classes, seed=seed, noise=noise, split=0)
    test_x, test_y = make_synthetic(test_size, input_shape, num_classes, seed=seed, noise=noise, split=1)
    info = DatasetInfo(
        name="synthetic",
        input_shape=input_shape,
        num_classes=num_classes,
        train_size=train_size,
        test_size=test_size,
    )
    return DatasetSplits(
        train=InMemoryDataset(train_x, train_y), test=InMemoryDataset(test_x, test_y), info=info
    )
