"""Datasets as a registry, like the models: register, list, build by name, refuse foreign options."""

from __future__ import annotations

import pytest
import torch

from revtrain.data import (
    DATASETS,
    DatasetInfo,
    DatasetSplits,
    InMemoryDataset,
    build_dataloaders,
    list_datasets,
    register_dataset,
)
from revtrain.data import registry


def test_builtin_datasets_are_registered() -> None:
    assert list(DATASETS[:5]) == ["digits", "cifar10", "cifar100", "synthetic", "text"]
    assert {"imagefolder", "imagenet32", "imagenet64"} <= set(list_datasets())
    assert list_datasets("imagenet*") == ["imagenet32", "imagenet64"]


def test_a_user_dataset_trains_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # leave the real registry as it was

    @register_dataset("ramp", description="a ramp")
    def ramp(*, image_size: int | None = None) -> DatasetSplits:
        side = image_size or 4
        x = torch.arange(6 * side * side, dtype=torch.float32).view(6, 1, side, side)
        y = torch.tensor([0, 1, 0, 1, 0, 1])
        info = DatasetInfo(name="ramp", input_shape=(1, side, side), num_classes=2, train_size=6, test_size=6)
        return DatasetSplits(train=InMemoryDataset(x, y), test=InMemoryDataset(x, y), info=info)

    assert "ramp" in list_datasets()
    train, _, info = build_dataloaders("Ramp", batch_size=3, image_size=2)
    assert info.input_shape == (1, 2, 2) and len(train) == 2
    with pytest.raises(ValueError, match="context only applies to the 'text' dataset, not 'Ramp'"):
        build_dataloaders("Ramp", batch_size=3, context=8)
    with pytest.raises(ValueError, match="data_dir does not apply to the 'ramp' dataset; it takes image_size"):
        build_dataloaders("ramp", batch_size=3, data_dir="x")
    with pytest.raises(ValueError, match="dataset 'ramp' is registered already"):
        register_dataset("ramp")(lambda: None)  # type: ignore[arg-type,return-value]


def test_unknown_dataset_suggests_close_names() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'imagefolders'.*did you mean imagefolder"):
        build_dataloaders("imagefolders", batch_size=8)
