"""One OS process per stage on torch.distributed (gloo): the same arithmetic as the simulator,
DDP and FSDP2 give one process's gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from revtrain.parallel.partition import split_model
from tests.parallel import data_parallel_cases
from tests.parallel.cases import (
    hybrid_rank,
    pipeline_case,
    pipeline_rank,
    reference_two_stages,
    run_ranks,
    run_simulator,
)

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]


CASES = [("toy", 2), ("revnet", 2), ("revnet", 3), ("revnet-lockstep", 3)]


def test_processes_equal_the_simulator_bit_for_bit(tmp_path: Path) -> None:
    """J=2 and J=3 pipelines in 3 gloo processes, messages overlapped with compute (gloo) and in
    lockstep (NCCL's exchange); every stage's weights and schedule equal the simulator's
    exactly, and for the toy both equal the hand-written delayed update."""
    run_ranks(pipeline_rank, 3, CASES, str(tmp_path))
    for case, num_stages in CASES:
        model, batches, config, split = pipeline_case(case, num_stages)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        sim = run_simulator(model, num_stages, batches, config, split)
        for rank, stage in enumerate(sim.stages):
            got = torch.load(tmp_path / f"{case}-J{num_stages}-rank{rank}.pt", weights_only=False)
            want = stage.unit_state_dict()
            for unit, state in want.items():
                for key, value in state.items():
                    assert torch.equal(got["units"][unit][key], value), (case, unit, key)
            assert got["events"] == sim.tickers[rank].events
        assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())
        if case == "toy":  # and both equal the hand-written delayed update
            model0, *_ = pipeline_case(case, num_stages)
            ref = reference_two_stages(model0, batches, lr=config.lr, k=config.accumulation,
                                       weight_decay=config.weight_decay)
            for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13, msg=name)


def test_data_parallel_and_sharded_gradients_equal_one_process(tmp_path: Path) -> None:
    """DDP and FSDP2 (per block and whole model), reversible blocks in M, C and mixed modes,
    2 gloo processes with half the batch each: every gradient equals one process on the
    whole batch (float64); a full state dict gathers the unsharded weights."""
    run_ranks(data_parallel_cases.check_rank, 2, str(tmp_path))
    done = sorted(p.name for p in tmp_path.iterdir())
    assert done == ["rank0.json", "rank1.json"]
    checked = json.loads((tmp_path / "rank0.json").read_text())
    assert len(checked) == 9  # 3 wrappers x 3 mode settings


def test_accumulated_data_parallel_steps_equal_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    """--accumulation 4 under DDP and FSDP2 on 2 gloo processes: the trainer's step equals one
    process on the 4 micro-batches joined (float64, two steps)."""
    run_ranks(data_parallel_cases.accumulation_rank, 2, str(tmp_path))
    assert json.loads((tmp_path / "accumulation.json").read_text()) == ["ddp", "fsdp"]


def test_two_stages_by_two_replicas_equal_one_pipeline_on_the_whole_batch(tmp_path: Path) -> None:
    """J = 2 x N = 2 on 4 gloo processes (the toy: no batch statistics, float64): every stage's
    weights equal the simulator's single pipeline on the whole batches, and a stage's two
    replicas hold the same weights bit for bit."""
    run_ranks(hybrid_rank, 4, str(tmp_path))
    model, batches, config, split = pipeline_case("toy", 2)
    sim = run_simulator(model, 2, batches, config, split)
    got = [torch.load(tmp_path / f"hybrid-rank{r}.pt", weights_only=False) for r in range(4)]
    for rank, state in enumerate(got):
        stage = rank // 2
        assert state["updates"] == sim.workers[stage].updates == 3  # 5 batches, k = 2: 2 full and 1 partial
        for unit, tensors in sim.stages[stage].unit_state_dict().items():
            for key, value in tensors.items():
                torch.testing.assert_close(state["units"][unit][key], value, rtol=1e-10, atol=1e-13,
                                           msg=lambda m, u=unit, k=key: f"rank {rank} {u}.{k}: {m}")
                assert torch.equal(state["units"][unit][key], got[rank ^ 1]["units"][unit][key])
