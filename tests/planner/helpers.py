"""A small reversible network for the planner tests that measure, independent of the model zoo."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from revtrain.core import ReversibleBlock, ReversibleSequence

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _preact(channels: int) -> nn.Module:
    """RevNet-style residual function on one half: BN-ReLU-conv3x3."""
    return nn.Sequential(
        nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False)
    )


class TinyRevNet(nn.Module):
    """Stem, 3 reversible blocks, a strided non-reversible conv, 2 reversible blocks, a head.

    A RevNet's shape (reversible stages between ordinary layers) at a size that profiles in
    about a second on a CPU.
    """

    def __init__(self, width: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.stage1 = ReversibleSequence(
            [ReversibleBlock(_preact(width // 2), _preact(width // 2)) for _ in range(3)]
        )
        self.down = nn.Sequential(
            nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        )
        self.stage2 = ReversibleSequence([ReversibleBlock(_preact(width), _preact(width)) for _ in range(2)])
        self.head = nn.Sequential(
            nn.BatchNorm2d(2 * width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(2 * width, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 3, H, W)
        return self.head(self.stage2(self.down(self.stage1(self.stem(x)))))


def tiny_model(seed: int = 0) -> TinyRevNet:
    torch.manual_seed(seed)
    return TinyRevNet()


def tiny_batch(batch_size: int = 8, size: int = 12, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, size, size, generator=gen)  # (B, C, H, W)
    return x, torch.randint(0, 10, (batch_size,), generator=gen)


def snapshot(model: nn.Module) -> dict:
    """Everything about a model that measuring it must leave unchanged."""
    from revtrain.core import get_modes

    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "modes": get_modes(model),
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_same(before: dict, after: dict) -> None:
    assert before["modes"] == after["modes"]
    assert before["training"] == after["training"]
    torch.testing.assert_close(after["rng"], before["rng"], rtol=0, atol=0)
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        torch.testing.assert_close(after["state"][k], before["state"][k], rtol=0, atol=0, msg=k)
    for g0, g1 in zip(before["grads"], after["grads"]):
        assert (g0 is None) == (g1 is None)
        if g0 is not None:
            torch.testing.assert_close(g1, g0, rtol=0, atol=0)
