"""Models, a hand-written reference of PETRA's update, and the code multi-process tests run per rank.

Rank functions are module-level so that spawned processes can import them.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.models import create_model, example_batch
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.distributed import DistributedPipeline, exit_rank
from revtrain.parallel.partition import split_model
from revtrain.parallel.simulator import Simulator
from revtrain.tasks import Classification


# -- models --------------------------------------------------------------------------------------


class Toy(nn.Module):
    """A zoo-shaped model (stem, stages, head) on vectors: stem and head are not reversible."""

    def __init__(self, width: int = 8, blocks: int = 3, classes: int = 3, dropout: float = 0.0,
                 downsample_at: int | None = None) -> None:
        super().__init__()
        half = width // 2

        def fn() -> nn.Module:
            layers: list[nn.Module] = [nn.Linear(half, half), nn.Tanh()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            return nn.Sequential(*layers)

        self.stem = nn.Sequential(nn.Linear(4, width), nn.Tanh())
        groups: list[nn.Module] = []
        for i in range(blocks):
            if downsample_at is not None and i == downsample_at:
                groups.append(nn.Sequential(nn.Linear(width, width), nn.Tanh()))  # not reversible
            groups.append(ReversibleSequence(ReversibleBlock(fn(), fn())))
        self.stages = nn.Sequential(*groups)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


def toy_batches(n: int, batch: int = 6, seed: int = 0, dtype: torch.dtype = torch.float64) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=gen, dtype=dtype), torch.randint(0, 3, (batch,), generator=gen))
            for _ in range(n)]


def small_revnet(seed: int = 0) -> nn.Module:
    """RevNet-38 for 1-channel 8x8 images (the digits' size)."""
    torch.manual_seed(seed)
    return create_model("revnet38", in_channels=1)


def revnet_batches(n: int, batch: int = 8) -> list[tuple[Tensor, Tensor]]:
    return [example_batch("revnet38", batch, input_size=(1, 8, 8), seed=100 + i) for i in range(n)]


def run_simulator(model: nn.Module, num_stages: int, batches: list, config: PetraConfig,
                  split: list[int] | None = None, epochs: int = 1) -> Simulator:
    stages = split_model(model, num_stages, split)
    sim = Simulator(stages, config=config, batch_size=batches[0][0].shape[0], task=Classification())
    for epoch in range(epochs):
        sim.train_epoch(epoch, batches)
    return sim


# -- the hand-written reference: PETRA's equations for two stages, plain autograd only ---------


def reference_two_stages(model: Toy, batches: list[tuple[Tensor, Tensor]], *, lr: float, k: int,
                         weight_decay: float, momentum: float = 0.9) -> Toy:
    """Train a copy of a 3-block ``Toy`` with PETRA, J=2, stage 0 = stem + block 0.

    Written from the paper's equations (5) and Algorithm 1 with the tick schedule of SPEC §5,
    independently of revtrain.parallel and of the core's rebuild: stage 0 runs the forward of
    batch t and the backward of batch t-2 at tick t; stage 1 runs batch t-1 (loss and backward
    at once); a backward rebuilds block 0's input from the output stage 1 sent back, with
    block 0's current parameters, by the coupling's inverse (x2 = y2 - G(y1), x1 = y1 - F(x2)),
    and recomputes the stem from its kept input; gradients are summed and averaged over k.
    """
    ref = copy.deepcopy(model)
    set_modes(ref, "C")  # plain autograd everywhere in the reference
    block0 = ref.stages[0].blocks[0]
    stage0 = [*ref.stem.parameters(), *block0.parameters()]
    stage1 = [p for m in (*ref.stages[1:], ref.head) for p in m.parameters()]

    def sgd(params: list[nn.Parameter]) -> torch.optim.SGD:
        decay = [p for p in params if p.dim() > 1]
        rest = [p for p in params if p.dim() <= 1]
        return torch.optim.SGD([{"params": decay, "weight_decay": weight_decay},
                                {"params": rest, "weight_decay": 0.0}], lr=lr, momentum=momentum, nesterov=True)

    opts = [sgd(stage0), sgd(stage1)]
    params = [stage0, stage1]
    counts = [0, 0]

    def after_backward(s: int) -> None:
        counts[s] += 1
        if counts[s] % k == 0:
            step(s, k)

    def step(s: int, passes: int) -> None:
        for p in params[s]:
            p.grad /= passes
        opts[s].step()
        opts[s].zero_grad(set_to_none=True)

    n = len(batches)
    kept: dict[int, Tensor] = {}
    up: dict[int, tuple[Tensor, Tensor]] = {}
    down: dict[int, tuple[Tensor, Tensor]] = {}
    for t in range(n + 2):
        new_up, new_down = {}, {}
        if t < n:  # stage 0 forward of batch t, no graph
            x, target = batches[t]
            kept[t] = x
            with torch.no_grad():
                h = ref.stem(x)
                x1, x2 = h.chunk(2, dim=1)
                y1 = x1 + block0.f(x2)
                y2 = x2 + block0.g(y1)
            new_up[t] = (torch.cat([y1, y2], 1), target)
        if 0 <= t - 2 < n:  # stage 0 backward of batch t-2 from (y~, dy) sent at tick t-1
            b = t - 2
            y, dy = down.pop(b)
            y1, y2 = y.chunk(2, dim=1)
            with torch.no_grad():  # rebuild with the current parameters
                x2 = y2 - block0.g(y1)
                x1 = y1 - block0.f(x2)
            x1 = x1.requires_grad_()
            x2 = x2.requires_grad_()
            z1 = x1 + block0.f(x2)
            z2 = x2 + block0.g(z1)
            torch.autograd.backward([z1, z2], list(dy.chunk(2, dim=1)))
            dh = torch.cat([x1.grad, x2.grad], 1)
            torch.autograd.backward(ref.stem(kept.pop(b)), dh)
            after_backward(0)
        if 0 <= t - 1 < n:  # stage 1: forward, loss and backward of batch t-1
            b = t - 1
            x, target = up.pop(b)
            xr = x.detach().requires_grad_()
            h = xr
            for group in ref.stages[1:]:
                h = group(h)
            F.cross_entropy(ref.head(h), target).backward()
            new_down[b] = (x, xr.grad)
            after_backward(1)
        up.update(new_up)
        down.update(new_down)
    for s in (0, 1):
        if counts[s] % k:
            step(s, counts[s] % k)
    return ref


# -- multi-process harness -----------------------------------------------------------------------


def run_ranks(fn: Callable[..., None], world: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined in a gloo group."""
    import torch.multiprocessing as mp

    store = Path(tempfile.mkdtemp(prefix="revtrain-ranks-")) / "store"  # a file rendezvous: no port to race for
    ctx = mp.start_processes(_entry, args=(fn, world, str(store), args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s")
    finally:
        shutil.rmtree(store.parent, ignore_errors=True)


def _entry(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    code = 1
    try:
        fn(rank, world, *args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        exit_rank(code)  # never through interpreter finalization (see exit_rank)


def pipeline_rank(rank: int, world: int, cases: list[tuple[str, int]], out_dir: str) -> None:
    """Per ``(case, J)``: ranks 0..J-1 run the case's pipeline on the distributed engine and save
    their stage's state and events; the other ranks sit it out."""
    for case, num_stages in cases:
        if rank < num_stages:
            _pipeline_case_rank(rank, num_stages, case, Path(out_dir) / f"{case}-J{num_stages}-rank{rank}.pt")


def _pipeline_case_rank(rank: int, num_stages: int, case: str, out: Path) -> None:
    model, batches, config, split = pipeline_case(case, num_stages)
    stages = split_model(model, num_stages, split)
    pipe = DistributedPipeline.for_rank(stages, rank, config=config, batch_size=batches[0][0].shape[0],
                                        task=Classification(), sample=batches[0])
    pipe.overlap = not case.endswith("-lockstep")  # the exchange NCCL uses, run here on gloo
    pipe.train_epoch(0, batches if rank == 0 else None, [b[0].shape[0] for b in batches])
    torch.save({"units": pipe.stage.unit_state_dict(), "events": pipe.ticker.events}, out)


def pipeline_case(case: str, num_stages: int) -> tuple[nn.Module, list, PetraConfig, list[int] | None]:
    """The model, data, options and split of a named multi-process case (the same in every process);
    a ``-lockstep`` suffix names the same case run with the lockstep exchange."""
    case = case.removesuffix("-lockstep")
    if case == "toy":
        torch.manual_seed(0)
        return (Toy().double(), toy_batches(5), PetraConfig(lr=0.05, accumulation=2, weight_decay=1e-3),
                [1, 2])
    if case == "revnet":
        return small_revnet(), revnet_batches(5), PetraConfig(lr=0.05, accumulation=2), None
    raise ValueError(case)


def hybrid_rank(rank: int, world: int, out_dir: str) -> None:
    """J = 2 stages x N = 2 replicas on a (pp, dp) device mesh: each replica's pipeline takes half
    of every batch of the toy case; the stage's replicas average their gradients before each update."""
    from torch.distributed.device_mesh import init_device_mesh

    num_stages, replicas = 2, world // 2
    model, batches, config, split = pipeline_case("toy", num_stages)
    index, replica = divmod(rank, replicas)
    mesh = init_device_mesh("cpu", (num_stages, replicas), mesh_dim_names=("pp", "dp"))
    stages = split_model(model, num_stages, split)
    half = batches[0][0].shape[0] // replicas
    pipe = DistributedPipeline.for_rank(stages, index, config=config, batch_size=batches[0][0].shape[0],
                                        task=Classification(), sample=(batches[0][0][:half], batches[0][1][:half]),
                                        stage_ranks=[j * replicas + replica for j in range(num_stages)])
    pipe.worker.replica_group = mesh.get_group("dp")
    mine = [(x.tensor_split(replicas)[replica], y.tensor_split(replicas)[replica]) for x, y in batches]
    pipe.train_epoch(0, mine if index == 0 else None, [half] * len(batches))
    torch.save({"units": pipe.stage.unit_state_dict(), "updates": pipe.worker.updates},
               Path(out_dir) / f"hybrid-rank{rank}.pt")
