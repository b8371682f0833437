"""The registry owns example inputs: every model accepts the batch built from its spec."""

import pytest
import torch

from revtrain.models import InputSpec, create_model, example_batch, input_spec, list_models, model_info, token_input


@pytest.mark.parametrize("name", list_models())
def test_every_model_accepts_its_example_batch(name):
    info = model_info(name)
    x, y = example_batch(name, 2, "meta")
    assert x.shape == (2, *info.inputs.shape) and x.dtype == info.inputs.dtype
    with torch.device("meta"):
        model = create_model(name)
    out = model(x)
    if info.inputs.kind == "image":
        assert y.shape == (2,) and out.shape == (2, info.num_classes)
    else:
        assert y.shape == x.shape and out.shape == (*x.shape, info.num_classes)


def test_example_batch_is_seeded_and_respects_overrides():
    a = example_batch("revnet38", 3, seed=5, input_size=(1, 8, 8), num_classes=7)
    b = example_batch("revnet38", 3, seed=5, input_size=(1, 8, 8), num_classes=7)
    c = example_batch("revnet38", 3, seed=6, input_size=(1, 8, 8), num_classes=7)
    assert a[0].shape == (3, 1, 8, 8) and int(a[1].max()) < 7
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a[0], c[0])
    assert input_spec("revnet38", num_classes=7).num_classes == 7


def test_token_spec_targets_are_the_next_ids():
    spec = token_input(context=16, vocab_size=256)
    x, y = spec.example(4, seed=1)
    assert x.dtype == torch.long and x.shape == (4, 16) and y.shape == (4, 16)
    assert int(x.max()) < 256 and int(x.min()) >= 0
    torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="audio", shape=(3,), num_classes=2), "kind"),
        (dict(kind="image", shape=(0, 8, 8), num_classes=2), "positive"),
        (dict(kind="image", shape=(1, 8, 8), num_classes=0), "num_classes"),
        (dict(kind="tokens", shape=(8,), dtype=torch.float32, num_classes=2), "integer ids"),
        (dict(kind="image", shape=(1, 8, 8), dtype=torch.long, num_classes=2), "float dtype"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        InputSpec(**kwargs)


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="batch_size"):
        example_batch("resnet32", 0)
