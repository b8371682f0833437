"""M-mode's safety checks are sampled, so a training step between samples makes no more
host-device synchronisations than C-mode: counted, per dispatched op, for one model of each
reversible family (coupling CNN, In-place ABN, Transformer, ViT)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from revtrain.core import set_modes
from revtrain.core.checks import FIRST_CHECKS
from revtrain.models import create_model, example_batch, model_info
from tests.op_log import OpLog

# The dispatched ops that read a tensor's value on the host (a CUDA device must finish first);
# .tolist() and .numpy() bypass the dispatcher, and a copy to the host looks like any copy here.
SYNCING = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item"}


def _syncs_of_an_unsampled_step(name: str, mode: str) -> dict[str, int]:
    info = model_info(name)
    size = {"input_size": (info.inputs.shape[0], 8, 8)} if info.inputs.kind == "image" else {}
    torch.manual_seed(0)
    model = create_model(name)
    set_modes(model, mode)
    x, y = example_batch(name, 2, **size)

    def step() -> None:
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()

    for _ in range(FIRST_CHECKS + 1):  # past the checked first calls, before the next sample
        step()
    with OpLog() as log:
        step()
    return dict(collections.Counter(op for op in log.ops if op in SYNCING))


@pytest.mark.parametrize("name", ["revnet38", "resnext29_iabn", "revformer_tiny", "revvit_digits"])
def test_an_unsampled_m_mode_step_syncs_no_more_than_c_mode(name):
    m_mode, c_mode = _syncs_of_an_unsampled_step(name, "M"), _syncs_of_an_unsampled_step(name, "C")
    assert all(n <= c_mode.get(op, 0) for op, n in m_mode.items()), (m_mode, c_mode)
