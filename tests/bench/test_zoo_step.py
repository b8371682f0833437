"""revtrain.bench.zoo_step: the M-mode zoo model and batch the step benchmarks share."""

from __future__ import annotations

import pytest

from revtrain.bench.zoo_step import m_mode_image_model
from revtrain.core import get_modes
from revtrain.models import model_info


def test_the_model_is_in_m_mode_with_a_batch_of_its_own_channels() -> None:
    model, x, y = m_mode_image_model("revnet38", 8, 4)
    assert set(get_modes(model).values()) == {"M"}
    channels = model_info("revnet38").inputs.shape[0]
    assert tuple(x.shape) == (4, channels, 8, 8) and tuple(y.shape) == (4,)
    again, x2, _ = m_mode_image_model("revnet38", 8, 4)
    assert x.equal(x2)  # seeded


@pytest.mark.parametrize(("name", "words"), [("resnet32", "no reversible layers"), ("revformer_tiny", "takes tokens"),
                                             ("no_such_model", "unknown model")])
def test_models_it_cannot_time_are_named(name: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        m_mode_image_model(name, 8, 2)
