"""PETRA inside the one :class:`~revtrain.train.Trainer`: the stage-parallel engine.

``revtrain train --stages J`` trains the model cut into J stages with delayed gradients
(Rivaud et al. 2024) through the ordinary :class:`~revtrain.train.Trainer`, which keeps
everything else a run does (the config, the run folder and its guard, epochs, evaluation,
metrics, checkpoints, Ctrl-C/SIGTERM, the divergence stop, the resume rules, the summary). :class:`PetraEngine` owns the step:

- **A step feeds ``k`` micro-batches** (``--accumulation``) into the pipeline: tick ``t`` of the
  epoch's pipeline reads batch ``t``, so a step runs ``k`` ticks; every stage updates after
  ``k`` backward passes (Algorithm 1), so an epoch has as many updates per stage as the
  Trainer counts steps. The epoch's last step also drains the pipeline (its last ``2(J-1)``
  ticks) and applies every stage's pending partial accumulation (flush).
- **The loss of a step** is that of the micro-batches whose forward reached the last stage
  during the step (the pipeline delays it by ``J - 1`` ticks, so an epoch's first steps
  may report none); the task's sums of the epoch add up to every batch's.
- **Checkpoints** are taken with nothing in flight: at the end of an epoch, or, inside one (a
  stop signal, ``--checkpoint-every``), after draining the pipeline and flushing the stages, so
  a run that was checkpointed mid-epoch differs from one that was not by that drain. A resumed
  run continues bit for bit from an end-of-epoch checkpoint. ``checkpoint.pt`` holds the whole
  model (the stages' weights gathered) and the loader's position; every stage also writes its own
  file (:mod:`revtrain.parallel.checkpoint`). A resume with another split is refused.
- **Evaluation** is an ordinary forward in evaluation mode: the whole model in the simulator, the
  stages in turn (one batch through the pipeline) on processes.

``engine="simulator"`` (``--engine simulator``) runs every stage in this process, tick by tick;
``engine="processes"`` is one rank of ``J x N`` processes on a ``(pp, dp)`` mesh (rank ``r`` is
stage ``r // N``, replica ``r % N``; each replica's pipeline takes ``1/N`` of every batch and a
stage's replicas average their gradients before each update). Both call the same per-stage code
in the same order, so their arithmetic is identical. Every rank reads the same batches (the
loaders are seeded alike, so positions and resume are the single-process run's); only the
first stage uses them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import revtrain.parallel.checkpoint as ckpt
import revtrain.parallel.schedule as schedule
from revtrain.memory import format_bytes, process_peak_rss_bytes
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.distributed import DistributedPipeline
from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.partition import split_model, stage_shapes
from revtrain.parallel.pipeline import StageTicker
from revtrain.parallel.simulator import Simulator
from revtrain.parallel.timing import time_units
from revtrain.parallel.units import model_units
from revtrain.tasks import add_sums
from revtrain.train.checkpoint_store import FileStore
from revtrain.train.engine import Batch
from revtrain.train.trainer_view import TrainerView

__all__ = ["PetraEngine", "measured_split", "parse_split"]


class PetraEngine:
    """The :class:`~revtrain.train.engine.Engine` of a PETRA run (module docstring).

    Args:
        simulate: Every stage in this process; otherwise this process is one rank of an
            initialised process group of ``stages x replicas`` ranks.
        replicas: Data-parallel replicas of every stage (processes only).
        timeout: Seconds a stage waits for a neighbour at any tick (processes only).
    """

    measures_memory = False  # the summary reports every stage's memory instead (report)

    def __init__(self, *, simulate: bool, replicas: int = 1, timeout: float = 60.0) -> None:
        if simulate:
            self.rank, self.world, self.replicas = 0, 1, 1
        else:
            if not dist.is_initialized():
                raise PipelineConfigError("PetraEngine(simulate=False) needs an initialised process group (init_from_env)")
            self.rank, self.world, self.replicas = dist.get_rank(), dist.get_world_size(), replicas
        self.simulate, self.timeout = simulate, timeout
        self.writes_files = self.rank == 0
        self.split: list[int] = []
        self.tickers: list[StageTicker] = []
        self._sim: Simulator | None = None
        self._pipe: DistributedPipeline | None = None
        self._trainer: TrainerView | None = None
        self._sizes: list[int] | None = None  # the sizes of the batches fed to the open pipeline

    # -- building ---------------------------------------------------------------------------------

    def describe(self) -> str:
        where = "every stage in this process (simulator)" if self.simulate else "one process per stage"
        copies = f" x {self.replicas} replicas" if self.replicas > 1 else ""
        return f"PETRA: {len(self.split)} stages{copies} of {'+'.join(map(str, self.split))} blocks, {where}"

    def attach(self, trainer: TrainerView) -> None:
        c = trainer.config
        assert c.stages is not None
        j, n = c.stages, self.replicas
        if not self.simulate and self.world != j * n:
            raise PipelineConfigError(f"{self.world} processes for {j} stages x {n} replicas: PETRA runs one process "
                                      f"per stage and replica; start {j * n} processes")
        self._trainer = trainer
        if trainer.resumed_state is not None:  # a data-parallel run's checkpoint folder: load it before the cut
            trainer.state.restore_tensors(trainer.resumed_state, c.resume)
        saved = (trainer.resumed_state or {}).get("petra")
        x, y = trainer.on_device(trainer.first_batch())
        stages = split_model(trainer.model, j, self._split(trainer, x, saved))
        stage_shapes(stages, x[:2], trainer.model)  # refuses a model whose forward is not its chain of units
        self.split = [st.num_blocks for st in stages]
        if saved is not None and saved["split"] != self.split:
            raise PipelineConfigError(
                f"checkpoint {c.resume} was trained with the split {','.join(map(str, saved['split']))} (blocks per "
                f"stage) and this run asks for {','.join(map(str, self.split))}; resume without --split, or with "
                f"--split {','.join(map(str, saved['split']))}"
            )
        petra = PetraConfig(accumulation=c.accumulation, lr=c.lr, momentum=c.momentum, nesterov=c.nesterov,
                            weight_decay=c.weight_decay, input_buffer=c.input_buffer, stash_params=c.stash_params,
                            track_reconstruction=c.track_reconstruction, dropout_seed=c.dropout_seed)
        if self.simulate:
            self._sim = Simulator(stages, config=petra, batch_size=c.batch_size, task=trainer.task,
                                  schedule=trainer.schedule)
            self.tickers = self._sim.tickers
        else:
            index, replica = divmod(self.rank, n)
            self._pipe = DistributedPipeline.for_rank(
                stages, index, config=petra, batch_size=c.batch_size, task=trainer.task, sample=(x, y),
                schedule=trainer.schedule, device=trainer.device, timeout_s=self.timeout,
                stage_ranks=[s * n + replica for s in range(j)])
            self._pipe.worker.replica_group = _replica_group(trainer.device, j, n)
            self.tickers = [self._pipe.ticker]
            for stage in stages:  # this process keeps its own stage only (checkpoints gather the stages)
                if stage is not self._pipe.stage:
                    for t in [*stage.parameters(), *stage.buffers()]:
                        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if saved is not None:
            folder = Path(str(c.resume)).parent / "checkpoints"
            for t in self._my_files():
                t.worker.load_state_dict(ckpt.load_stage(folder, t.index, saved["step"])["worker"])

    def _split(self, trainer: TrainerView, x: torch.Tensor, saved: Mapping[str, Any] | None) -> list[int] | list[str] | None:
        c = trainer.config
        if c.split is not None:
            return parse_split(c.split)
        if saved is not None:  # the resumed run's split, not a new measurement
            return list(saved["split"])
        if c.balance == "count" or c.stages == 1:
            return None
        if self.simulate:
            return measured_split(trainer.model, c.stages, x)  # type: ignore[arg-type]
        box = [measured_split(trainer.model, c.stages, x) if self.rank == 0 else None]  # type: ignore[arg-type]
        dist.broadcast_object_list(box, src=0)  # one measurement for every rank
        return box[0]

    # -- the step ------------------------------------------------------------------------------------

    def step(self, trainer: TrainerView, batches: Sequence[Batch]) -> tuple[torch.Tensor | None, dict[str, float]]:
        if self._sizes is None:  # the first step of an epoch (or after a mid-epoch checkpoint) opens the pipeline
            self._start(trainer.train_loader.epoch)
        assert self._sizes is not None
        data = []
        for x, y in batches:
            if self.replicas > 1:  # this replica's slice of every batch
                x, y = x.tensor_split(self.replicas)[self.rank % self.replicas], y.tensor_split(self.replicas)[self.rank % self.replicas]
            self._sizes.append(len(y))
            data.append(trainer.on_device((x, y)))
        self._advance(len(self._sizes), iter(data))
        if trainer.epoch_done:
            self._drain()
        return None, self._take_sums()

    def apply(self, trainer: TrainerView) -> None:
        with warnings.catch_warnings():  # the stages updated themselves, each after its k-th backward;
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)  # the
            trainer.advance_schedule()  # trainer's schedule only counts the steps (and gives the lr of the records)

    def all_sum(self, sums: Mapping[str, float], loss: torch.Tensor | None) -> tuple[dict[str, float], float | None]:
        total = self._gather_sums(sums)
        count = total.get("count", 0.0)
        return total, (total["loss_sum"] / count if count else None)

    def forward_backward(self, trainer: TrainerView, batch: Batch, total: int, *, last: bool) -> Any:
        raise PipelineConfigError("a PETRA step runs its micro-batches through the pipeline of stages "
                                  "(Trainer.train_step); there is no forward-backward of one micro-batch alone")

    def _start(self, epoch: int) -> None:
        self._sizes = []
        if self._sim is not None:
            self._sim.start(epoch)
        else:
            assert self._pipe is not None
            self._pipe.start(epoch)

    def _advance(self, stop_batches: int, data: Any, *, drain: bool = False) -> None:
        assert self._sizes is not None
        stop = schedule.num_ticks(len(self._sizes), len(self.split)) if drain else stop_batches
        if self._sim is not None:
            self._sim.advance(stop, len(self._sizes), data)
        else:
            assert self._pipe is not None
            self._pipe.advance(stop, self._sizes, data)

    def _drain(self) -> None:
        """Finish every batch in flight (the pipeline's last ticks) and apply the partial accumulations."""
        if self._sizes is None:
            return
        self._advance(0, iter(()), drain=True)
        for t in self.tickers:
            t.worker.flush()
        self._sizes = None

    def _take_sums(self) -> dict[str, float]:
        last = self.tickers[-1].worker
        if not last.stage.is_last:
            return {}
        sums, last.train_sums = last.train_sums, {}
        return sums

    def _gather_sums(self, sums: Mapping[str, float]) -> dict[str, float]:
        if self.simulate:
            return dict(sums)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, dict(sums))
        total: dict[str, float] = {}
        for mine in every:
            add_sums(total, mine)
        return total

    # -- evaluation ----------------------------------------------------------------------------------

    def eval_sums(self, trainer: TrainerView, batch: Batch) -> dict[str, float]:
        x, y = trainer.on_device(batch)
        if self._pipe is None:  # the model's forward is its stages in turn
            return trainer.task.batch_sums(trainer.model(x), y)
        pipe = self._pipe
        sums = pipe.evaluate(trainer.task, [(x, y)] if pipe.stage.is_first else None, [len(y)])
        counted = pipe.stage.is_last and self.rank % self.replicas == 0  # every replica ran the whole batch
        return self._gather_sums(sums if counted else {})

    def agree_stop(self, signum: int | None) -> int | None:
        if self.simulate:
            return signum
        flag = torch.tensor([signum or 0], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None

    def _collective_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- checkpoints ---------------------------------------------------------------------------------

    def settle(self, trainer: TrainerView) -> None:
        """Before a checkpoint inside an epoch: drain the pipeline, flush the stages, and count what
        the drained batches' losses add to the epoch's sums."""
        if self._sizes is None:
            return
        self._drain()
        trainer.progress.epoch.add(self._gather_sums(self._take_sums()), 0, 0.0)

    def checkpoint_store(self, trainer: TrainerView) -> FileStore:
        """``checkpoint.pt`` in the single-process format, its model assembled from the stages on
        rank 0 (:meth:`_full_state`); every stage also writes its own file."""
        return FileStore(trainer, self._full_state)

    def _full_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Write this process's stage files and gather every stage's weights into ``state`` on
        rank 0 (every process calls it)."""
        trainer = self._trainer
        assert trainer is not None
        step, folder = trainer.step, trainer.run_dir / "checkpoints"
        for t in self._my_files():
            ckpt.save_stage(folder, t.index, step, {"worker": t.worker.state_dict()})
        state["petra"] = {"stages": len(self.split), "split": self.split, "step": step}
        if self._pipe is not None:  # the whole model's weights: every stage's units, gathered on rank 0
            mine = self._pipe.stage.unit_state_dict() if self.rank % self.replicas == 0 else {}
            every: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
            dist.gather_object({k: {n: v.cpu() for n, v in s.items()} for k, s in mine.items()}, every, dst=0)
            if self.rank == 0:
                model = dict(state["model"])
                for units in every:
                    for unit, tensors in units.items():
                        model.update({f"{unit}.{name}": value for name, value in tensors.items()})
                state["model"] = model
        return state

    def saved(self) -> None:
        if not self.simulate:
            dist.barrier()
        trainer = self._trainer
        assert trainer is not None
        for t in self._my_files():
            ckpt.prune(trainer.run_dir / "checkpoints", t.index, trainer.step)

    def _my_files(self) -> list[StageTicker]:
        """The stages whose files this process writes and reads (a stage's first replica)."""
        return self.tickers if self.rank % self.replicas == 0 else []

    # -- the summary ---------------------------------------------------------------------------------

    def report(self, trainer: TrainerView) -> tuple[dict[str, Any], list[str]]:
        mine = [_stage_report(t) for t in self.tickers] if self.rank % self.replicas == 0 else []
        if not self.simulate:
            every: list[Any] = [None] * self.world
            dist.all_gather_object(every, mine)
            mine = [r for ranks in every for r in ranks]
        stages = sorted(mine, key=lambda r: r["stage"])
        lines = [f"PETRA, {len(stages)} stages{f' x {self.replicas} replicas' if self.replicas > 1 else ''} "
                 f"({'simulator' if self.simulate else 'processes'}), memory per stage:"]
        for m in stages:
            lines.append(f"  stage {m['stage']} ({m['first_unit']} .. {m['last_unit']}): parameters "
                         f"{format_bytes(m['param_bytes'])}, optimizer {format_bytes(m['optimizer_bytes'])}, kept inputs "
                         f"{format_bytes(m['peak_buffer_bytes'])} at most, peak RSS {format_bytes(m['peak_rss_bytes'])}")
        petra = {"stages": len(stages), "replicas": self.replicas, "engine": "simulator" if self.simulate else "processes",
                 "split": self.split, "memory": stages}
        return {"petra": petra}, lines


def _stage_report(ticker: StageTicker) -> dict[str, Any]:
    w = ticker.worker
    errors = w.reconstruction_errors
    return {
        "stage": w.stage.index, "first_unit": w.stage.units[0].name, "last_unit": w.stage.units[-1].name,
        "reversible": w.stage.reversible, "updates": w.updates,
        "param_bytes": sum(p.numel() * p.element_size() for p in w.params),
        "optimizer_bytes": sum(t.numel() * t.element_size() for st in w.optimizer.state.values()
                               for t in st.values() if isinstance(t, torch.Tensor)),
        "peak_buffer_bytes": ticker.peak_buffer_bytes,
        "reconstruction_error": sum(errors) / len(errors) if errors else None,
        "peak_rss_bytes": process_peak_rss_bytes(),
    }


def _replica_group(device: torch.device, stages: int, replicas: int) -> Any:
    """The process group of this rank's stage replicas on a 2-D ``(pp, dp)`` device mesh; None for one replica."""
    if replicas == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (stages, replicas), mesh_dim_names=("pp", "dp")).get_group("dp")


def measured_split(model: torch.nn.Module, num_stages: int, sample: torch.Tensor) -> list[int]:
    """Blocks per stage balanced by each unit's measured time on ``sample`` (a training batch)."""
    costs = time_units(model_units(model), sample, repeats=5, warmup=2)
    stages = split_model(model, num_stages, costs=([c.stage_cost for c in costs], [c.plain_s for c in costs]))
    return [s.num_blocks for s in stages]


def parse_split(text: str | None) -> list[int] | list[str] | None:
    """``"3,3,2"`` -> ``[3, 3, 2]``; ``"stages.1.transition,..."`` -> names; None -> None."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise PipelineConfigError(f"split {text!r} is empty; give counts (3,3,2) or block names")
    if all(p.lstrip("-").isdigit() for p in parts):
        return [int(p) for p in parts]
    if any(p.lstrip("-").isdigit() for p in parts):
        raise PipelineConfigError(f"split {text!r} mixes counts and names; give one or the other")
    return parts
