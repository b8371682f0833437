"""Counted: the schedule's delays, what each stage keeps, batch-norm updates, dropout replay."""

from __future__ import annotations

import pytest
import torch

from revtrain.memory import track_peak_memory
from revtrain.parallel import schedule
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.partition import split_model
from revtrain.parallel.simulator import Simulator
from revtrain.parallel.worker import StageWorker
from revtrain.tasks import Classification
from tests.parallel.cases import Toy, revnet_batches, run_simulator, small_revnet, toy_batches

# RevNet-38's 9 blocks as 1 | 2 | 3 | 3: stage 1 (stages.0 blocks 1-2) is all reversible; stages 0
# and 2 hold a non-reversible unit (the stem, a downsampling transition).
REV_SPLIT = [1, 2, 3, 3]


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_backward_runs_2_J_minus_1_minus_s_ticks_after_forward(num_stages: int) -> None:
    batches = toy_batches(6, dtype=torch.float32)
    torch.manual_seed(0)
    sim = run_simulator(Toy(blocks=4), num_stages, batches, PetraConfig(lr=0.01))
    forward, backward = {}, {}
    for e in sim.events:
        if e.kind in ("F", "FB"):
            assert (e.stage, e.batch) not in forward
            forward[e.stage, e.batch] = e.tick
        if e.kind in ("B", "FB"):
            assert (e.stage, e.batch) not in backward
            backward[e.stage, e.batch] = e.tick
    assert len(forward) == len(backward) == num_stages * len(batches)
    for (s, b), tick in forward.items():
        assert tick == b + s
        assert backward[s, b] - tick == 2 * (num_stages - 1 - s)
        assert (s == num_stages - 1) == (backward[s, b] == tick)  # the last stage: loss + backward at once
    assert max(e.tick for e in sim.events) + 1 == schedule.num_ticks(len(batches), num_stages)


def test_reversible_stages_keep_nothing_and_others_keep_exactly_the_batches_in_flight() -> None:
    batches = revnet_batches(6)
    stages = split_model(small_revnet(), 4, REV_SPLIT)
    assert [st.reversible for st in stages] == [False, True, False, False]
    sim = Simulator(stages, config=PetraConfig(lr=0.05), batch_size=8, task=Classification())
    seen = []

    def check(tick: int, s: Simulator) -> None:
        for w in s.workers[:-1]:
            flying = schedule.in_flight_after(w.stage.index, tick, len(batches), 4)
            assert w.in_flight == flying
            assert w.stashed_versions == 0
            assert w.stored_inputs == (0 if w.stage.reversible else flying)
            seen.append((w.stage.index, flying))

    sim.train_epoch(0, batches, on_tick=check)
    assert sim.tickers[1].peak_buffer_bytes == 0
    assert sim.tickers[0].peak_buffer_bytes > 0 and sim.tickers[2].peak_buffer_bytes > 0
    assert max(f for s, f in seen if s == 0) == 2 * 3  # 2(J-1-s) batches between ticks
    assert max(f for s, f in seen if s == 2) == 2 * 1


def test_memory_tracker_counts_no_kept_bytes_for_a_reversible_stage() -> None:
    """Forwards of d batches without their backwards: a reversible stage holds 0 bytes more, a
    stage with a non-reversible unit holds exactly the d kept inputs."""
    stages = split_model(small_revnet(), 4, REV_SPLIT)
    workers = [StageWorker(st, config=PetraConfig(), batch_size=8) for st in stages[:3]]
    shapes = [(8, 32, 8, 8), (8, 32, 8, 8), (8, 32, 8, 8)]  # inputs of stages 0..2 (stage 0 below)
    shapes[0] = (8, 1, 8, 8)
    for w, shape in zip(workers, shapes):
        with track_peak_memory("cpu") as mem:
            for b in range(3):
                x = torch.randn(shape)
                y = w.forward(b, x)
                del x, y
        kept = 0 if w.stage.reversible else 3 * torch.Size(shape).numel() * 4
        assert mem.end_bytes == kept, (w.stage.index, mem.end_bytes, kept)
        assert w.buffer_bytes() == kept


def test_batch_norm_statistics_update_once_per_batch_in_the_backward() -> None:
    model = small_revnet()
    batches = revnet_batches(5)
    stages = split_model(model, 4, REV_SPLIT)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    before = [m.running_mean.clone() for m in norms]
    sim = Simulator(stages, config=PetraConfig(lr=0.05), batch_size=8, task=Classification())
    sim.workers[0].forward(0, batches[0][0])  # a forward alone updates nothing
    assert all(int(m.num_batches_tracked) == 0 for m in norms)
    assert all(torch.equal(m.running_mean, b) for m, b in zip(norms, before))
    sim.workers[0].input_buffer.clear()
    sim.workers[0]._in_flight.clear()
    sim.train_epoch(0, batches)
    assert [int(m.num_batches_tracked) for m in norms] == [5] * len(norms)
    assert all(not torch.equal(m.running_mean, b) for m, b in zip(norms, before))


def test_dropout_replays_exactly() -> None:
    """With the forward's parameters (stash_params), a rebuild through dropout is exact: the
    masks of the forward are replayed, not drawn anew."""
    torch.manual_seed(0)
    model = Toy(blocks=4, dropout=0.5).double()
    config = PetraConfig(lr=0.1, stash_params=True, track_reconstruction=True)
    sim = run_simulator(model, 2, toy_batches(6), config, split=[2, 2])
    worker = sim.workers[0]
    assert worker.random and len(worker.reconstruction_errors) == 6
    assert max(worker.reconstruction_errors) < 1e-12
    # Without the stash the parameters moved between forward and backward: PETRA's approximate
    # rebuild (the quantity `revtrain bench petra` tracks over training).
    torch.manual_seed(0)
    sim = run_simulator(Toy(blocks=4, dropout=0.5).double(), 2, toy_batches(6),
                        PetraConfig(lr=0.1, track_reconstruction=True), split=[2, 2])
    assert max(sim.workers[0].reconstruction_errors) > 1e-6


def test_input_buffer_modes() -> None:
    with pytest.raises(PipelineConfigError, match="stage 0 holds non-reversible units.*stem.*input_buffer='needed'"):
        run_simulator(small_revnet(), 4, revnet_batches(1), PetraConfig(input_buffer="none"), split=REV_SPLIT)
    stages = split_model(small_revnet(), 4, REV_SPLIT)
    sim = Simulator(stages, config=PetraConfig(input_buffer="all"), batch_size=8, task=Classification())
    peak = []
    sim.train_epoch(0, revnet_batches(4), on_tick=lambda t, s: peak.append(s.workers[1].stored_inputs))
    assert max(peak) == 2 * (4 - 1 - 1)  # the reversible stage now keeps its input for every batch in flight


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_accumulation_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(PipelineConfigError, match="accumulation"):
        PetraConfig(accumulation=bad)  # type: ignore[arg-type]
