"""Parameter groups (no decay on norms and biases) and the per-step learning-rate schedule."""

from __future__ import annotations

import math

import pytest

from revtrain.layers import InPlaceABN
from torch import nn

from revtrain.models import create_model
from revtrain.train import LRSchedule, build_optimizer, build_scheduler, param_groups


def _names(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("name", ["revnet38", "resnet32", "resnext29_iabn"])
def test_no_weight_decay_on_norm_parameters_and_biases(name: str) -> None:
    model = create_model(name)
    optimizer = build_optimizer(model, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["decay"]["weight_decay"] == 5e-4 and groups["no_decay"]["weight_decay"] == 0.0
    decay, no_decay = _names(model, groups["decay"]["params"]), _names(model, groups["no_decay"]["params"])
    modules = dict(model.named_modules())
    owner = {n: modules[n.rpartition(".")[0]] for n, _ in model.named_parameters()}
    norms = (nn.BatchNorm2d, InPlaceABN)  # In-place ABN's scale must not decay towards 0
    expected_no_decay = {n for n, m in owner.items() if isinstance(m, norms) or n.endswith(".bias")}
    assert expected_no_decay, "the zoo models have batch norms"
    assert no_decay == expected_no_decay
    assert decay == set(owner) - expected_no_decay  # every other parameter, each exactly once
    assert all(isinstance(owner[n], (nn.Conv2d, nn.Linear)) and n.endswith(".weight") for n in decay)


def test_param_groups_cover_shared_and_frozen_parameters_correctly() -> None:
    linear = nn.Linear(4, 4)
    model = nn.Sequential(linear, nn.LayerNorm(4), linear, nn.GroupNorm(2, 4), nn.Linear(4, 2, bias=False))
    model[4].weight.requires_grad_(False)
    groups = {g["name"]: g["params"] for g in param_groups(model, 0.1)}
    assert [tuple(p.shape) for p in groups["decay"]] == [(4, 4)]  # shared weight once, frozen one absent
    assert len(groups["no_decay"]) == 1 + 2 + 2  # linear bias, LayerNorm and GroupNorm weight + bias


def test_warmup_then_cosine_values() -> None:
    s = LRSchedule(total_steps=20, warmup_steps=4, kind="cosine")
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(4) == 1.0  # the first step after warm-up runs at the peak
    assert s.factor(12) == pytest.approx(0.5)  # half way through the decay
    assert s.factor(19) == pytest.approx(0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert s.factor(20) == pytest.approx(0.0)


def test_step_schedule_values() -> None:
    s = LRSchedule(total_steps=20, warmup_steps=2, kind="step", milestones=(0.5, 0.75), gamma=0.1)
    factors = [s.factor(i) for i in range(20)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2:10] == [1.0] * 8
    assert factors[10:15] == pytest.approx([0.1] * 5) and factors[15:] == pytest.approx([0.01] * 5)


def test_scheduler_sets_the_rate_of_every_group_each_step() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    optimizer = build_optimizer(model, lr=0.2, momentum=0.9, nesterov=False, weight_decay=1e-4)
    schedule = LRSchedule(total_steps=10, warmup_steps=3)
    scheduler = build_scheduler(optimizer, schedule)
    seen = []
    for _ in range(10):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert seen == [[0.2 * schedule.factor(i)] * 2 for i in range(10)]
    assert scheduler.state_dict()["lr_lambdas"] == [None, None]  # position only; schedule comes from config


def test_trainer_lr_per_step_follows_the_schedule(tiny_config) -> None:  # type: ignore[no-untyped-def]
    import json
    from pathlib import Path

    from revtrain.train import Trainer

    config = tiny_config(lr=0.1, warmup_epochs=1.0)
    trainer = Trainer(config)
    trainer.fit()
    records = [json.loads(line) for line in Path(config.run_dir, "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if r["event"] == "step"]  # the rate for the *next* step
    assert lrs == pytest.approx([0.1 * trainer.schedule.factor(s) for s in range(1, 7)])
    assert trainer.schedule.warmup_steps == 3 and trainer.schedule.total_steps == 6
