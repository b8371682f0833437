"""Data parallelism for reversible models: DDP, and FSDP2 sharding with M-mode blocks.

Reversible blocks in M-mode, C-mode or any planned mix train under both of PyTorch's data
parallel wrappers with gradients equal to one process on the N-times batch (tested with two
gloo processes):

- :func:`replicate` wraps a model in ``DistributedDataParallel``. M-mode backward returns the
  parameter gradients through autograd like any layer, so DDP's gradient hooks and bucketed
  all-reduce see them as usual.
- :func:`shard` applies FSDP2's ``fully_shard`` to every reversible layer (per block) and then
  to the whole model, or to the whole model only. Every process then holds 1/N of the
  parameters, gradients and optimizer state: how to train a model bigger than one device.
  M-mode blocks inside a ``ReversibleSequence`` run outside FSDP's module hooks;
  :mod:`revtrain.core.sharding` makes their parameters whole around their forward and their
  rebuild, as the hooks would.

Batch norm under data parallelism normalises with each process's own batch (as DDP always
does); convert to ``nn.SyncBatchNorm`` on CUDA for statistics over the global batch.

Checkpoints: :func:`full_state_dict` gathers the whole model's state on every rank (save it
from rank 0); :func:`load_full_state_dict` loads one into a replicated or sharded model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from revtrain.core import Invertible

__all__ = ["replicate", "shard", "full_grads", "full_state_dict", "load_full_state_dict"]


def replicate(model: nn.Module, device: torch.device | None = None, *, sync_buffers: bool = True,
              **ddp_options: Any) -> nn.Module:
    """``DistributedDataParallel(model)`` (the process group must be initialised).

    Args:
        model: The model, on this rank's device.
        device: This rank's CUDA device (``device_ids=[device]``); None on CPU.
        sync_buffers: Whether DDP copies rank 0's buffers to every rank at each forward
            (``forward_sync_buffers``; ``broadcast_buffers`` before torch 2.13, which it deprecates).
        **ddp_options: Passed to ``DistributedDataParallel``.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if device is not None and device.type == "cuda":
        ddp_options.setdefault("device_ids", [device])
    if not sync_buffers:
        takes = inspect.signature(DistributedDataParallel.__init__).parameters
        ddp_options["forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers"] = False
    return DistributedDataParallel(model, **ddp_options)


def shard(model: nn.Module, *, per_block: bool = True, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``), in place; returns it.

    Args:
        model: The model (on this rank's device; the process group must be initialised).
        per_block: Also shard every reversible layer on its own (each gathers its parameters
            only while it runs); False shards the whole model as one group.
        reshard_after_forward: Free the gathered parameters after the forward (FSDP's default).
    """
    from torch.distributed.fsdp import fully_shard

    if per_block:
        for _, module in list(model.named_modules()):
            if isinstance(module, Invertible):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def full_grads(model: nn.Module) -> dict[str, Tensor | None]:
    """Every parameter's whole gradient by name (sharded gradients are gathered)."""
    out: dict[str, Tensor | None] = {}
    for name, p in _named_params(model):
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g
    return out


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's state on every rank, keys as in the unwrapped model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(_unwrapped(model), options=StateDictOptions(full_state_dict=True))


def load_full_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a whole-model state (e.g. from :func:`full_state_dict`) into a wrapped or sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(_unwrapped(model), state, options=StateDictOptions(full_state_dict=True))


def _unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def _named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(_unwrapped(model).named_parameters())
