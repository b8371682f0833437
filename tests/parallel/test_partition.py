"""Cutting zoo models into stages: units, explicit and balanced splits, and the errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from revtrain.models import create_model
from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.partition import balanced_counts, split_model, stage_shapes
from revtrain.parallel.timing import time_units
from revtrain.parallel.units import model_units
from tests.parallel.cases import Toy


@pytest.mark.parametrize(
    ("name", "blocks", "reversible_blocks"),
    [("revnet38", 9, 7), ("revnet18", 8, 5), ("revnet50", 16, 12), ("resnet32", 15, 0), ("resnet18", 8, 0)],
)
def test_units_of_zoo_models(name: str, blocks: int, reversible_blocks: int) -> None:
    with torch.device("meta"):
        units = model_units(create_model(name))
    assert units[0].role == "stem" and units[-1].role == "head"
    assert not units[0].reversible and not units[-1].reversible
    assert sum(u.role == "block" for u in units) == blocks
    assert sum(u.reversible for u in units) == reversible_blocks


def test_stem_goes_first_head_goes_last_and_stages_know_if_reversible() -> None:
    with torch.device("meta"):
        model = create_model("revnet38")
    stages = split_model(model, 4, [1, 2, 3, 3])
    assert stages[0].units[0].name == "stem" and stages[-1].units[-1].name == "head"
    assert [st.num_blocks for st in stages] == [1, 2, 3, 3]
    assert [st.reversible for st in stages] == [False, True, False, False]
    assert [u.name for u in stages[1].units] == ["stages.0.reversible.blocks.1", "stages.0.reversible.blocks.2"]
    assert sum(len(st.units) for st in stages) == len(model_units(model))


def test_split_by_names_and_even_default() -> None:
    with torch.device("meta"):
        model = create_model("revnet38")
    by_name = split_model(model, 3, ["stages.1.transition", "stages.2.transition"])
    assert [st.num_blocks for st in by_name] == [3, 3, 3]
    assert by_name[1].units[0].name == "stages.1.transition"
    assert [st.num_blocks for st in split_model(model, 4)] == [3, 2, 2, 2]


@pytest.mark.parametrize(
    ("num_stages", "split", "message"),
    [
        (0, None, "number of stages must be an integer >= 1"),
        (-2, None, "number of stages must be an integer >= 1"),
        (10, None, "10 stages for a model of 9 blocks.*at most 9"),
        (2, [3, 3], "covers 6 blocks but the model has 9"),
        (2, [0, 9], "at least one block"),
        (3, [4, 5], "2 entries for 3 stages"),
        (2, ["stages.9.nothing"], "not a block of this model"),
        (3, ["stages.2.transition", "stages.1.transition"], "forward order"),
        (2, [4, "stages.1.transition"], "counts per stage"),
    ],
)
def test_bad_splits_are_refused_before_anything_runs(num_stages: int, split: list | None, message: str) -> None:
    with torch.device("meta"):
        model = create_model("revnet38")
    with pytest.raises(PipelineConfigError, match=message):
        split_model(model, num_stages, split)


def test_a_model_that_is_not_a_chain_of_units_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="cannot cut a Linear"):
        model_units(torch.nn.Linear(2, 2))

    class Skip(Toy):  # uses the stem's output again at the end: not a chain
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            return self.head(self.stages(h) + h)

    model = Skip()
    with pytest.raises(PipelineConfigError, match="not the chain of its units"):
        stage_shapes(split_model(model, 2), torch.randn(2, 4), model)


def test_balanced_split_minimises_the_slowest_stage() -> None:
    rng = random.Random(0)
    for _ in range(30):
        n, j = rng.randint(1, 7), rng.randint(1, 4)
        if j > n:
            continue
        with torch.device("meta"):
            units = model_units(Toy(blocks=n))
        fwd = [rng.uniform(0.1, 2.0) for _ in units]
        last = [rng.uniform(0.1, 2.0) for _ in units]
        counts = balanced_counts(fwd, last, units, j)
        assert sum(counts) == n and min(counts) >= 1

        def worst(c: tuple[int, ...]) -> float:
            bounds = list(itertools.accumulate(c, initial=0))
            costs = []
            for s in range(j):
                idx = list(range(1 + bounds[s], 1 + bounds[s + 1]))  # units: stem, blocks, head
                if s == 0:
                    idx = [0, *idx]
                if s == j - 1:
                    idx = [*idx, len(units) - 1]
                costs.append(sum((last if s == j - 1 else fwd)[i] for i in idx))
            return max(costs)

        best = min(worst(c) for c in itertools.product(range(1, n + 1), repeat=j) if sum(c) == n)
        assert worst(tuple(counts)) == pytest.approx(best)


def test_unit_timing_leaves_the_model_as_it_was() -> None:
    model = create_model("revnet38", in_channels=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    costs = time_units(model_units(model), torch.randn(4, 1, 8, 8), repeats=1, warmup=0)
    assert len(costs) == 11 and all(c.forward_s > 0 and c.petra_backward_s > 0 and c.plain_s > 0 for c in costs)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
