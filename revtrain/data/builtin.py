"""The datasets revtrain ships, registered under their ``--dataset`` names.

Each entry adapts a builder to the registry's options (:mod:`revtrain.data.registry`): the
defaults that depend on the dataset (CIFAR augments, digits does not) and the checks of options
the dataset cannot honour live here.
"""

from __future__ import annotations

import os

from revtrain.data.cifar import build_cifar10, build_cifar100
from revtrain.data.digits import build_digits
from revtrain.data.imagefolder import build_image_folder
from revtrain.data.imagenet_npz import build_downsampled_imagenet
from revtrain.data.loader import DatasetSplits
from revtrain.data.registry import register_dataset
from revtrain.data.synthetic import build_synthetic
from revtrain.data.text import build_text

__all__: list[str] = []

PathLike = str | os.PathLike[str] | None


@register_dataset("digits", description="scikit-learn's 1,797 handwritten digits, 8x8, bundled (offline)")
def digits(*, image_size: int | None = None, augment: bool | None = None) -> DatasetSplits:
    return build_digits(image_size=image_size or 8, augment=bool(augment))


def _cifar(name: str, data_dir: PathLike, image_size: int | None, augment: bool | None) -> DatasetSplits:
    if image_size not in (None, 32):
        raise ValueError(f"{name} images are 32x32; image_size={image_size} is not supported")
    build = build_cifar10 if name == "cifar10" else build_cifar100
    return build(data_dir, augment=True if augment is None else augment)


@register_dataset("cifar10", description="CIFAR-10 from its python batches in --data-dir")
def cifar10(*, data_dir: PathLike = None, image_size: int | None = None, augment: bool | None = None) -> DatasetSplits:
    return _cifar("cifar10", data_dir, image_size, augment)


@register_dataset("cifar100", description="CIFAR-100 from its python batches in --data-dir")
def cifar100(*, data_dir: PathLike = None, image_size: int | None = None, augment: bool | None = None) -> DatasetSplits:
    return _cifar("cifar100", data_dir, image_size, augment)


@register_dataset("synthetic", description="seeded random images of any shape (benchmarks)")
def synthetic(*, image_size: int | None = None, input_shape: tuple[int, ...] | None = None,
              num_classes: int | None = None, train_size: int | None = None, test_size: int | None = None,
              augment: bool | None = None, seed: int = 0) -> DatasetSplits:
    if augment:
        raise ValueError("the 'synthetic' dataset has no augmentation; leave augment unset")
    if image_size is not None and input_shape is not None:
        raise ValueError("give either image_size or input_shape for 'synthetic', not both")
    side = 32 if image_size is None else image_size  # a 0 given is refused below, not replaced
    shape = input_shape if input_shape is not None else (3, side, side)
    return build_synthetic(input_shape=shape, num_classes=10 if num_classes is None else num_classes,
                           train_size=1024 if train_size is None else train_size,
                           test_size=256 if test_size is None else test_size, seed=seed)


@register_dataset("text", description="bytes of local text files (default: the Python standard library's sources)")
def text(*, data_dir: PathLike = None, context: int | None = None, augment: bool | None = None) -> DatasetSplits:
    return build_text(data_dir, context=128 if context is None else context,
                      augment=True if augment is None else augment)


@register_dataset("imagefolder", description="your images: --data-dir D with D/train/<class>/ and D/val/<class>/")
def imagefolder(*, data_dir: PathLike = None, image_size: int | None = None,
                augment: bool | None = None) -> DatasetSplits:
    return build_image_folder(data_dir, image_size=image_size, augment=augment)


def _imagenet(size: int):  # type: ignore[no-untyped-def]
    def build(*, data_dir: PathLike = None, image_size: int | None = None,
              augment: bool | None = None) -> DatasetSplits:
        if image_size not in (None, size):
            raise ValueError(f"imagenet{size} images are {size}x{size}; image_size={image_size} is not supported "
                             "(pick the ImageNet variant of that size)")
        return build_downsampled_imagenet(size, data_dir, augment=augment)

    return build


for _size in (32, 64):
    register_dataset(f"imagenet{_size}", description=f"downsampled ImageNet {_size}x{_size} (PETRA's data), npz "
                                                     "batches in --data-dir")(_imagenet(_size))
