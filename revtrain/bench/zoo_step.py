"""What the benchmarks that time whole training steps of a zoo model share: the model in M-mode
with one batch."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from revtrain.core import reversible_blocks, set_modes
from revtrain.models import create_model, input_spec, model_info

__all__ = ["m_mode_image_model"]


def m_mode_image_model(model_name: str, side: int, batch_size: int,
                       device: torch.device | str = "cpu") -> tuple[nn.Module, Tensor, Tensor]:
    """A reversible image model of the zoo with every reversible layer in M-mode, built from
    seed 0 for 10 classes on ``side``×``side`` images of its own channels, and one batch
    ``(x, y)`` of ``batch_size``. Raises ``ValueError`` naming the problem for an unknown model,
    a model of other inputs than images, or one without reversible layers."""
    spec = model_info(model_name).inputs  # an unknown name raises, with close matches
    if spec.kind != "image":
        raise ValueError(f"{model_name} takes {spec.kind}; this benchmark feeds images (a RevNet)")
    spec = input_spec(model_name, input_size=(spec.shape[0], side, side))
    torch.manual_seed(0)
    example = spec.example(batch_size)
    x = (example[0] if isinstance(example, (tuple, list)) else example).to(device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    model = create_model(model_name, in_channels=spec.shape[0], num_classes=10).to(device)
    if not reversible_blocks(model):
        raise ValueError(f"{model_name} has no reversible layers, so nothing is rebuilt or checked")
    set_modes(model, "M")
    return model, x, y
