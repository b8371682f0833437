"""Data-parallel checkpoints (torch.distributed.checkpoint folders) resume with another number of
processes: 1 -> 2 and 2 -> 1, DDP and FSDP2, on gloo, exactly (float64); a single-process
run's checkpoint.pt continues sharded on two processes; a checkpoint folder continues as a PETRA
run on processes; a file store whose processes hold parts agrees on non-finite weights.

Every run trains the same float64 reversible net on digits (group norms: no batch statistics,
so N slices of a batch give the whole batch's gradient up to the order of float additions) for
2 epochs x 2 steps. An uninterrupted single-process run is the reference; each data-parallel
run is interrupted after step 3 (mid-epoch, with momentum in the optimizer) and resumed with
another number of processes, which then takes step 4. Its weights after step 4 equal the
reference's to float64 rounding, which they could not if the weights, the momentum, the data
position or the schedule came back wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from revtrain.cli import main
from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.train import TrainConfig, Trainer
from revtrain.train.checkpoint_folder import MANIFEST_NAME, latest_checkpoint, read_checkpoint
from revtrain.train.checkpoint_store import FileStore, FolderStore
from revtrain.train.engine import LocalEngine
from tests.parallel.cases import run_ranks

pytestmark = pytest.mark.multiprocess

KINDS = {"ddp": False, "fsdp": True}


def _half(channels: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(1, channels), nn.Tanh())


class _Net(nn.Module):
    """Digits (1 x 8 x 8, float32 from the loader) into a float64 reversible net, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1, dtype=torch.float64)
        self.seq = ReversibleSequence([ReversibleBlock(_half(4), _half(4)) for _ in range(2)]).double()
        self.head = nn.Linear(8, 10, dtype=torch.float64)
        set_modes(self, {"seq.blocks.0": "M", "seq.blocks.1": "C"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.seq(self.stem(x.double()))
        return self.head(h.mean(dim=(2, 3)))


def _config(run_dir: Path, **overrides: Any) -> TrainConfig:
    options: dict[str, Any] = dict(
        model="dcp-net", dataset="digits", image_size=8, batch_size=12, eval_batch_size=360, epochs=2,
        max_steps_per_epoch=2, warmup_epochs=0, weight_decay=1e-3, device="cpu", quiet=True,
        memory_report=False, run_dir=str(run_dir),
    )
    return TrainConfig(**{**options, **overrides})


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _stop_after_3(trainer: Trainer) -> None:
    if trainer.step == 3:
        raise KeyboardInterrupt("stopped after step 3")


def _train_until_3(run_dir: Path, sharded: bool) -> None:
    from revtrain.parallel.replicas import DataParallelEngine

    trainer = Trainer(_config(run_dir), model=_net(), engine=DataParallelEngine(sharded=sharded),
                      callbacks=[_stop_after_3])
    try:
        trainer.fit()
    except KeyboardInterrupt:
        return
    raise AssertionError("the run was not interrupted")


def _resume(run_dir: Path, sharded: bool) -> None:
    from revtrain.parallel.replicas import DataParallelEngine

    Trainer(_config(run_dir, resume=str(run_dir)), model=_net(), engine=DataParallelEngine(sharded=sharded)).fit()


def one_process_rank(rank: int, world: int, out_dir: str) -> None:
    """--data-parallel 1: start the runs that two processes will resume."""
    for kind, sharded in KINDS.items():
        _train_until_3(Path(out_dir, f"{kind}-1to2"), sharded)


def two_process_rank(rank: int, world: int, out_dir: str) -> None:
    """Resume the one-process runs on two processes; start the runs one process will resume."""
    for kind, sharded in KINDS.items():
        _resume(Path(out_dir, f"{kind}-1to2"), sharded)
        _train_until_3(Path(out_dir, f"{kind}-2to1"), sharded)
        dist.barrier()
    _resume(Path(out_dir, "file-to-fsdp"), True)  # a single-process run's checkpoint.pt, sharded


def test_data_parallel_runs_resume_exactly_with_another_number_of_processes(tmp_path: Path) -> None:
    reference = Trainer(_config(tmp_path / "reference"), model=_net())
    reference.fit()
    want = reference.model.state_dict()
    run_ranks(one_process_rank, 1, str(tmp_path))
    single = tmp_path / "file-to-fsdp"
    with pytest.raises(KeyboardInterrupt):
        Trainer(_config(single), model=_net(), callbacks=[_stop_after_3]).fit()
    assert latest_checkpoint(single) == single / "checkpoint.pt"
    for kind in KINDS:
        folder = latest_checkpoint(tmp_path / f"{kind}-1to2")
        assert folder is not None and folder.name == "step-00000003"
    run_ranks(two_process_rank, 2, str(tmp_path), timeout=300.0)  # a hang guard for five short trainings
    # FSDP2 on two processes: each wrote its own shards, neither the whole model
    shards = sorted((tmp_path / "fsdp-2to1" / "checkpoints" / "step-00000003").glob("__*.distcp"))
    sizes = [p.stat().st_size for p in shards]
    assert len(sizes) == 2 and min(sizes) > 0.3 * sum(sizes), sizes
    for kind in KINDS:  # two processes -> one (no process group: the single-process trainer)
        run = tmp_path / f"{kind}-2to1"
        assert (run / "checkpoints" / "step-00000003" / MANIFEST_NAME).is_file()
        Trainer(_config(run, resume=str(run)), model=_net()).fit()
    assert latest_checkpoint(single) == single / "checkpoints" / "step-00000004"  # checkpoint.pt superseded
    assert not (single / "checkpoint.pt").exists()
    for name in ("ddp-1to2", "fsdp-1to2", "ddp-2to1", "fsdp-2to1", "file-to-fsdp"):
        latest = latest_checkpoint(tmp_path / name)
        assert latest is not None
        state = read_checkpoint(latest)
        assert state["progress"]["step"] == 4 and state["progress"]["processes"] == 2, name
        assert state["model"].keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(state["model"][key], value, rtol=1e-10, atol=1e-13,
                                       msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
    start = _net().state_dict()
    assert any(not torch.equal(start[k], v) for k, v in want.items())


class _NormNet(_Net):
    """_Net with batch norm after the stem: its input (the stem's output) does not depend on how
    the batch is cut, so its statistics can be computed here from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.seq(self.bn(self.stem(x.double())))
        return self.head(h.mean(dim=(2, 3)))


def _norm_net() -> _NormNet:
    torch.manual_seed(0)
    return _NormNet()


def batch_norm_rank(rank: int, world: int, out_dir: str) -> None:
    from revtrain.parallel.replicas import DataParallelEngine

    for kind, sharded in KINDS.items():
        config = _config(Path(out_dir, kind), epochs=1, max_steps_per_epoch=1)
        Trainer(config, model=_norm_net(), engine=DataParallelEngine(sharded=sharded)).fit()


def test_data_parallel_runs_save_the_batch_norm_statistics_of_every_process(tmp_path: Path) -> None:
    """One step on 2 processes (slices of 6 of a batch of 12), DDP and FSDP2: the saved running
    mean is the whole batch's (as one process on it would track), the running variance the mean
    of the two slices' (each about its own mean): every process's statistics count, not rank 0's."""
    run_ranks(batch_norm_rank, 2, str(tmp_path))
    probe = Trainer(_config(tmp_path / "probe"), model=_norm_net())
    x, _ = probe.first_batch()
    with torch.no_grad():
        h = probe.model.stem(x.double())  # (B, C, H, W): the batch norm's input in the step's forward
    slices = h.tensor_split(2)
    momentum = probe.model.bn.momentum
    mean = momentum * h.mean(dim=(0, 2, 3))
    var = (1 - momentum) + momentum * torch.stack([s.var(dim=(0, 2, 3)) for s in slices]).mean(dim=0)
    rank0 = momentum * slices[0].mean(dim=(0, 2, 3))
    assert (mean - rank0).abs().max() > 1e-3  # what rank 0 alone would have saved differs
    for kind in KINDS:
        state = read_checkpoint(latest_checkpoint(tmp_path / kind))
        assert state["progress"]["step"] == 1
        torch.testing.assert_close(state["model"]["bn.running_mean"], mean, rtol=1e-12, atol=1e-14, msg=kind)
        torch.testing.assert_close(state["model"]["bn.running_var"], var, rtol=1e-12, atol=1e-14, msg=kind)


_ALIKE = [0.1, 1 / 3, 0.7, 123.456, 1e-300]
"""Values for which N equal float64 values summed and divided by N do not come back (N = 3)."""


class _Buffers(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        alike = torch.tensor(_ALIKE, dtype=torch.float64)
        self.register_buffer("alike64", alike.clone())
        self.register_buffer("alike32", alike.float())
        self.register_buffer("mine", torch.tensor([float(rank), 2.0 * rank + 0.5], dtype=torch.float64))
        self.register_buffer("constant", torch.tensor([float(rank)]), persistent=False)
        self.register_buffer("count", torch.tensor(rank))


def average_buffers_rank(rank: int, world: int, out_dir: str) -> None:
    from revtrain.parallel.replicas import average_buffers

    model = _Buffers(rank)
    average_buffers(model)
    torch.save(dict(model.named_buffers()), Path(out_dir, f"rank{rank}.pt"))


def test_buffers_held_alike_stay_exactly_as_they_are_on_three_processes(tmp_path: Path) -> None:
    """The data-parallel engine's buffer mean on 3 processes: float64 and float32 buffers every
    process holds alike come back bit for bit (a plain sum over the processes divided by 3 does
    not), buffers that differ become their mean on every process, non-persistent (constants)
    and integer buffers are left alone."""
    alike = torch.tensor(_ALIKE, dtype=torch.float64)
    assert not torch.equal((alike + alike + alike) / 3, alike)  # the arithmetic this guards against
    run_ranks(average_buffers_rank, 3, str(tmp_path))
    for rank in range(3):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["alike64"], alike) and torch.equal(got["alike32"], alike.float()), rank
        assert torch.equal(got["mine"], torch.tensor([1.0, 2.5], dtype=torch.float64)), rank
        assert torch.equal(got["constant"], torch.tensor([float(rank)])), rank
        assert int(got["count"]) == rank


class _FolderEngine(LocalEngine):
    """One process, checkpoints written as the data-parallel engine writes them (a DCP folder)."""

    def checkpoint_store(self, trainer: Trainer) -> FolderStore:
        return FolderStore(trainer)


def test_a_checkpoint_folder_continues_as_a_petra_run_on_processes(tmp_path: Path) -> None:
    """PETRA cuts the model into stages, each rank keeping its own: a checkpoint folder's weights
    load into the whole model before the cut. The same run saved as a folder and as a file, each
    resumed as 2 PETRA stages (the folder on 2 processes, the file in the simulator, which the
    processes equal bit for bit), end with equal weights."""
    tiny = dict(model="revnet38", dataset="digits", epochs=1, max_steps_per_epoch=2, batch_size=16,
                eval_batch_size=360, threads=1, quiet=True, memory_report=False)
    Trainer(TrainConfig(**tiny, run_dir=str(tmp_path / "folder")), engine=_FolderEngine()).fit()
    Trainer(TrainConfig(**tiny, run_dir=str(tmp_path / "file"))).fit()
    folder = tmp_path / "folder" / "checkpoints" / "step-00000002"
    assert latest_checkpoint(tmp_path / "folder") == folder
    saved = read_checkpoint(folder)["model"]
    as_file = read_checkpoint(tmp_path / "file" / "checkpoint.pt")["model"]
    assert all(torch.equal(saved[k], v) for k, v in as_file.items())  # the same run, saved twice
    petra = ["train", "--stages", "2", "--balance", "count", "--epochs", "2", "--threads", "1", "--quiet"]
    assert main([*petra, "--engine", "simulator", "--resume", str(tmp_path / "file")]) == 0
    assert main([*petra, "--resume", str(tmp_path / "folder")]) == 0
    want = read_checkpoint(tmp_path / "file" / "checkpoint.pt")
    got = read_checkpoint(tmp_path / "folder" / "checkpoint.pt")
    assert got["progress"]["step"] == want["progress"]["step"] == 4 and got["petra"]["split"] == [5, 4]
    assert got["model"].keys() == want["model"].keys() == saved.keys()
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert any(not torch.equal(got["model"][k], v) for k, v in saved.items())  # the resumed run trained


def non_finite_part_rank(rank: int, world: int, out_dir: str) -> None:
    """Each process holds a part of the model (as PETRA's stages do); rank 1's part is NaN."""
    trainer = SimpleNamespace(run_dir=Path(out_dir), config=SimpleNamespace(keep_checkpoints=None))
    store = FileStore(trainer, lambda state: state)  # type: ignore[arg-type]
    part = torch.full((2,), float("nan") if rank == 1 else 1.0)
    _, bad = store.prepare({"model": {f"part{rank}.weight": part}})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(bad))


def test_every_process_of_a_file_store_sees_non_finite_weights_held_elsewhere(tmp_path: Path) -> None:
    """The trainer stops every process before a save when any process's part of the weights is
    NaN; a process that went on would wait for the others at the save's barrier."""
    run_ranks(non_finite_part_rank, 2, str(tmp_path))
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [["part1.weight"]] * 2
