"""M-mode blocks under FSDP2 (``fully_shard``): their forward and rebuild see whole parameters.

One process (a gloo group of one) is enough to reproduce what broke: an M-mode run of a
``ReversibleSequence`` calls its blocks outside their FSDP hooks, so without
``revtrain.core.sharding`` F and G met sharded DTensor parameters. The two-process test with
gradients against one process on the whole batch is tests/parallel/test_multiprocess.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes

fsdp = pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture
def group_of_one(tmp_path):
    # A file rendezvous: no port to race other processes for.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _half() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh())


@pytest.mark.parametrize("per_block", [True, False])
def test_m_mode_sequence_under_fully_shard_matches_plain_autograd(group_of_one, per_block: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), ReversibleSequence([ReversibleBlock(_half(), _half()) for _ in range(3)]),
                          nn.Linear(6, 2)).double()
    set_modes(model, "M")
    plain = copy.deepcopy(model)
    set_modes(plain, "C")
    # A CPU mesh, named: on a machine with a GPU, FSDP2 would otherwise put the shards on CUDA.
    mesh = init_device_mesh("cpu", (1,))
    if per_block:
        for block in model[1].blocks:
            fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    x = torch.randn(5, 6, dtype=torch.float64)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("attribute", ["_fsdp_param_groups", "_fsdp_param_group"])
def test_a_sharded_layer_is_found_whatever_the_torch_version_calls_its_groups(attribute: str) -> None:
    """Recent PyTorch keeps a list of parameter groups, older versions (2.11) one group: a
    layer with a sharded group must be unsharded under either."""
    from types import SimpleNamespace

    from revtrain.core.sharding import _is_whole

    def layer(unsharded: bool) -> SimpleNamespace:
        group = SimpleNamespace(is_unsharded=unsharded)
        state = SimpleNamespace(**{attribute: [group] if attribute.endswith("s") else group})
        return SimpleNamespace(_get_fsdp_state=lambda: state)

    assert not _is_whole(layer(False))
    assert _is_whole(layer(True))
    assert _is_whole(SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace()))  # no parameters
