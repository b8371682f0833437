"""What each rank of the data-parallel test runs (module-level so spawned processes import it)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.parallel.data_parallel import full_grads, full_state_dict, replicate, shard


def _half(channels: int) -> nn.Module:
    # GroupNorm, not BatchNorm: batch statistics over half a batch differ from the whole batch's.
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(1, channels), nn.Tanh())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.seq = ReversibleSequence([ReversibleBlock(_half(4), _half(4)) for _ in range(3)])
        self.alone = ReversibleBlock(_half(4), _half(4))  # a block outside any sequence
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.alone(self.seq(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


_MODES = {"M": "M", "C": "C", "mixed": {"seq.blocks.0": "C", "seq.blocks.1": "M", "seq.blocks.2": "M", "alone": "C"}}


def check_rank(rank: int, world: int, out_dir: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * world, 1, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2 * world,), generator=gen)
    mine = slice(2 * rank, 2 * rank + 2)
    checked = []
    for wrapper in ("ddp", "fsdp_per_block", "fsdp_whole_model"):
        for modes in ("M", "C", "mixed"):
            torch.manual_seed(0)
            model = _Net().double()
            set_modes(model, _MODES[modes])
            ref = copy.deepcopy(model)
            F.cross_entropy(ref(x), y).backward()  # one process, the whole batch
            if wrapper == "ddp":
                wrapped = replicate(model)
            else:
                wrapped = shard(model, per_block=wrapper == "fsdp_per_block")
            F.cross_entropy(wrapped(x[mine]), y[mine]).backward()
            got = full_grads(wrapped)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-13,
                                           msg=lambda m, n=name: f"{wrapper} {modes} {n}: {m}")
            state = full_state_dict(wrapped)
            for name, value in ref.state_dict().items():
                assert torch.equal(state[name], value), (wrapper, modes, name)
            checked.append(f"{wrapper}/{modes}")
            dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(checked))


def accumulation_rank(rank: int, world: int, out_dir: str) -> None:
    """The trainer with DDP and with FSDP2 engines: 4 micro-batches of 6, each split over the
    ranks, then the same again (momentum); rank 0 compares every weight with one process taking
    one batch of 24, in float64 (revvit_digits: layer norms, no batch statistics)."""
    from revtrain.parallel.replicas import DataParallelEngine
    from revtrain.train import TrainConfig, Trainer

    torch.set_default_dtype(torch.float64)
    options = dict(model="revvit_digits", batch_size=6, weight_decay=1e-3, device="cpu", quiet=True,
                   memory_report=False, max_steps_per_epoch=3, epochs=1)
    checked = []
    for sharded in (False, True):
        run = Path(out_dir, f"{'fsdp' if sharded else 'ddp'}")
        trainer = Trainer(TrainConfig(**options, accumulation=4, run_dir=str(run)),
                          engine=DataParallelEngine(sharded=sharded))
        loader = iter(trainer.train_loader)
        parts = [(x.double(), y) for x, y in (next(loader) for _ in range(4))]
        losses = [trainer.train_step(*parts)[0] for _ in range(2)]
        state = full_state_dict(trainer.model)
        if rank == 0:
            one = Trainer(TrainConfig(**options, run_dir=str(run) + "-one"))
            whole = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
            want = [one.train_step(whole)[0] for _ in range(2)]
            assert losses == [pytest_approx(w) for w in want], (losses, want)
            for name, value in one.model.state_dict().items():
                torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-13,
                                           msg=lambda m, n=name: f"sharded={sharded} {n}: {m}")
            checked.append("fsdp" if sharded else "ddp")
        dist.barrier()
    if rank == 0:
        Path(out_dir, "accumulation.json").write_text(json.dumps(checked))


def pytest_approx(value: float) -> object:
    import pytest

    return pytest.approx(value, rel=1e-12)
