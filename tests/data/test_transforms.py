"""Batched crop / flip / normalise against per-image references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from revtrain.data.transforms import BatchTransform, normalize, random_crop, random_hflip


def _images(b: int = 16, c: int = 3, h: int = 8, w: int = 8) -> torch.Tensor:
    return torch.rand(b, c, h, w, generator=torch.Generator().manual_seed(0)) + 0.1  # no zeros


def test_random_crop_is_a_per_image_shift_of_the_zero_padded_image():
    x = _images()
    pad = 2
    out = random_crop(x, pad, torch.Generator().manual_seed(1))
    assert out.shape == x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    offsets = set()
    for i in range(len(x)):
        matches = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.equal(out[i], padded[i, :, dy : dy + 8, dx : dx + 8])
        ]
        assert len(matches) == 1, f"image {i} is not a crop of its padded self"
        offsets.add(matches[0])
    assert len(offsets) > 3  # offsets are drawn per image, not once per batch
    assert not torch.equal(out, x)


def test_random_crop_is_seeded_and_zero_padding_is_identity():
    x = _images()
    a = random_crop(x, 4, torch.Generator().manual_seed(3))
    b = random_crop(x, 4, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert random_crop(x, 0) is x


def test_hflip_flips_a_random_subset_exactly():
    x = _images(b=64)
    out = random_hflip(x, torch.Generator().manual_seed(0))
    flipped = torch.tensor([torch.equal(o, xi.flip(-1)) for o, xi in zip(out, x, strict=True)])
    kept = torch.tensor([torch.equal(o, xi) for o, xi in zip(out, x, strict=True)])
    assert bool((flipped ^ kept).all())
    assert 10 < int(flipped.sum()) < 54
    assert torch.equal(random_hflip(x, p=1.0), x.flip(-1))


def test_normalize_per_channel():
    x = _images(c=2)
    out = normalize(x, (0.5, 0.25), (2.0, 4.0))
    torch.testing.assert_close(out[:, 0], (x[:, 0] - 0.5) / 2.0)
    torch.testing.assert_close(out[:, 1], (x[:, 1] - 0.25) / 4.0)


def test_batch_transform_eval_is_deterministic_and_train_is_not():
    x = (_images() * 200).to(torch.uint8)
    train = BatchTransform(
        scale=1 / 255, mean=(0.5,) * 3, std=(0.25,) * 3, train=True, crop_padding=2, hflip=True
    )
    evaluate = train.for_eval()
    assert train.is_random and not evaluate.is_random
    e1, e2 = evaluate(x), evaluate(x, torch.Generator().manual_seed(5))
    assert torch.equal(e1, e2) and e1.dtype == torch.float32
    torch.testing.assert_close(e1, (x.float() / 255 - 0.5) / 0.25)
    t = train(x, torch.Generator().manual_seed(5))
    assert t.shape == e1.shape and not torch.equal(t, e1)
    # Padding happens before normalisation: padded pixels are black (0), i.e. -mean/std.
    assert torch.isclose(t, torch.tensor(-2.0)).any()


def test_batch_transform_validates():
    with pytest.raises(ValueError, match="mean and std"):
        BatchTransform(mean=(0.0,))
    with pytest.raises(ValueError, match="crop_padding"):
        BatchTransform(crop_padding=-1)
