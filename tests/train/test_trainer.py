"""The Trainer end to end: outputs, memory modes (mode, plan, budget), the memory report, errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from revtrain.core import get_modes, reversible_blocks
from revtrain.models import create_model
from revtrain.planner import Plan, PlanMismatchError
from revtrain.train import ConfigError, Trainer, measure_step_memory

from .conftest import TinyConfig


def _events(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_fit_writes_metrics_summary_and_one_line_per_epoch(tiny_config: TinyConfig) -> None:
    config = tiny_config(memory_report=True)
    out = io.StringIO()
    summary = Trainer(config, out=out).fit()
    run = Path(config.run_dir)
    files = {"checkpoint.pt", "config.json", "metrics.jsonl", "summary.json", "steps.csv", "epochs.csv", "curves.png"}
    assert {p.name for p in run.iterdir()} == files
    events = _events(run)
    assert [e["event"] for e in events] == ["step"] * 3 + ["epoch"] + ["step"] * 3 + ["epoch", "summary"]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4, 5, 6]
    epoch = events[3]
    fields = {"train_loss", "train_acc", "test_loss", "test_acc", "lr", "samples_per_s", "memory_bytes"}
    assert fields <= set(epoch)
    assert json.loads((run / "summary.json").read_text()) == summary
    assert summary["steps"] == 6 and 0 <= summary["test_acc"] <= 1 and summary["samples_per_s"] > 0
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("epoch ") for line in lines) == 2
    assert any(line.startswith("step memory (batch 16, 7 M / 0 C of 7 reversible blocks)") for line in lines)
    assert json.loads((run / "config.json").read_text())["run_dir"] == config.run_dir


def test_memory_report_measures_m_mode_below_plain_backprop(tiny_config: TinyConfig) -> None:
    trainer = Trainer(tiny_config())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rng = torch.get_rng_state()
    report = measure_step_memory(trainer.model, trainer.first_batch(), get_modes(trainer.model),
                                 trainer.device, trainer._autocast)
    # Seven M-mode blocks keep nothing for backward; in C-mode each keeps its F/G activations.
    assert 0 < report.run_bytes < report.plain_bytes
    assert report.to_dict()["blocks_in_M"] == 7
    # The measurement ran on copies: weights, BN statistics, grads and RNG are untouched.
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert set(get_modes(trainer.model).values()) == {"M"}


def test_memory_report_of_a_plain_model_equals_plain_backprop(tiny_config: TinyConfig) -> None:
    trainer = Trainer(tiny_config(model="resnet32"))
    report = measure_step_memory(trainer.model, trainer.first_batch(), {}, trainer.device, trainer._autocast)
    assert report.run_bytes == report.plain_bytes > 0


def test_mode_c_sets_every_block(tiny_config: TinyConfig) -> None:
    trainer = Trainer(tiny_config(mode="C"))
    assert set(get_modes(trainer.model).values()) == {"C"} and len(get_modes(trainer.model)) == 7


@pytest.mark.parametrize("every", [0, 4])
def test_check_every_sets_every_reversible_layer_and_is_named_in_the_header(tiny_config: TinyConfig, every: int) -> None:
    config = tiny_config(check_every=every, epochs=1, max_steps_per_epoch=2)
    out = io.StringIO()
    trainer = Trainer(config, out=out)
    layers = [layer for _, layer in reversible_blocks(trainer.model)]
    assert len(layers) == 7
    assert all(layer.check_reconstruction == (every > 0) and layer.check_every == max(every, 1) for layer in layers)
    trainer.fit()
    note = "rebuild check off" if every == 0 else f"rebuild check every {every} steps"
    assert note in out.getvalue().splitlines()[0]
    assert json.loads(Path(config.run_dir, "config.json").read_text())["check_every"] == every


def test_without_check_every_the_layers_keep_the_checks_they_were_built_with(
    tiny_config: TinyConfig
) -> None:
    """A model whose author built its blocks with their own check settings keeps them unless
    --check-every is given (the zoo's blocks check every step)."""
    def built_with_own_checks() -> torch.nn.Module:  # given as a model object (Trainer(model=...))
        model = create_model("revnet38", in_channels=1, num_classes=10)
        for _, layer in reversible_blocks(model):
            layer.check_every = 8
        return model

    trainer = Trainer(tiny_config(), model=built_with_own_checks())
    assert all(layer.check_reconstruction and layer.check_every == 8 for _, layer in reversible_blocks(trainer.model))
    assert "rebuild check" not in trainer._header()
    trainer = Trainer(tiny_config("asked", check_every=2), model=built_with_own_checks())
    assert all(layer.check_every == 2 for _, layer in reversible_blocks(trainer.model))


def test_the_header_names_no_check_where_every_block_is_in_c_mode(tiny_config: TinyConfig) -> None:
    assert "rebuild check" not in Trainer(tiny_config(mode="C", check_every=0))._header()


def _plan_for(model_name: str, c_blocks: int) -> Plan:
    names = [name for name, _ in reversible_blocks(create_model(model_name))]
    modes = {name: ("C" if i < c_blocks else "M") for i, name in enumerate(names)}
    return Plan(modes=modes, budget_bytes=10**9, granularity=1, predicted_step_time_s=0.1,
                predicted_peak_bytes=10**6, model=model_name)


def test_plan_file_is_applied_and_kept_in_the_run_folder(tiny_config: TinyConfig, tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    _plan_for("revnet38", c_blocks=3).to_json(plan_path)
    config = tiny_config(plan=str(plan_path))
    trainer = Trainer(config)
    assert list(get_modes(trainer.model).values()) == ["C"] * 3 + ["M"] * 4
    assert Plan.from_json(Path(config.run_dir) / "plan.json").modes == get_modes(trainer.model)


def test_plan_for_another_model_is_refused(tiny_config: TinyConfig, tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    _plan_for("revnet110", c_blocks=1).to_json(plan_path)
    with pytest.raises(PlanMismatchError, match="made for 'revnet110'"):
        Trainer(tiny_config(plan=str(plan_path)))


def test_missing_plan_file_says_how_to_make_one(tiny_config: TinyConfig, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; make one with `revtrain plan`"):
        Trainer(tiny_config(plan=str(tmp_path / "nope.json")))


def test_budget_plans_before_training_without_touching_the_model(tiny_config: TinyConfig) -> None:
    reference = Trainer(tiny_config("reference"))
    reference_rng = torch.get_rng_state()
    config = tiny_config("budget", budget="4GiB")
    out = io.StringIO()
    trainer = Trainer(config, out=out)
    plan = Plan.from_json(Path(config.run_dir) / "plan.json")
    assert plan.modes == get_modes(trainer.model)
    assert plan.budget_bytes == 4 * 2**30 and plan.summary() in out.getvalue()
    # A budget far above the all-C peak: the planner keeps every block's input (C-mode, fastest).
    assert set(plan.modes.values()) == {"C"}
    # Profiling left no trace: weights, BN statistics and random state as if it had not run.
    ref_state, state = reference.model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(ref_state[k], state[k]) for k in ref_state)
    assert torch.equal(torch.get_rng_state(), reference_rng)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_fp16_amp_needs_cuda(tiny_config: TinyConfig) -> None:
    # Issue 24: bf16 autocast runs on the CPU too (tests/train/test_devices_and_precision.py); fp16's
    # gradient scaler stays CUDA-only.
    with pytest.raises(ConfigError, match="--amp fp16 needs CUDA .its gradient scaler.*--amp bf16 on the CPU"):
        Trainer(tiny_config(amp="fp16"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_device_without_cuda_is_refused(tiny_config: TinyConfig) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        Trainer(tiny_config(device="cuda"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"epochs": 0}, "epochs must be an integer >= 1"),
        ({"momentum": 0.0}, "Nesterov momentum needs momentum > 0"),
        ({"milestones": (0.8, 0.2)}, "milestones must be increasing"),
        ({"budget": "1GiB", "plan": "p.json"}, "either --budget .* or --plan"),
        ({"plan": "p.json", "mode": "C"}, "--mode C with --plan: the plan sets each block's mode; drop --mode"),
        ({"budget": "1GiB", "mode": "C"}, "--mode C with --budget"),
        ({"schedule": "linear"}, "schedule must be one of cosine, step"),
        ({"check_every": -1}, "check_every must be an integer >= 0"),
    ],
)
def test_bad_config_values_are_named(tiny_config: TinyConfig, overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_a_budget_for_a_model_without_reversible_blocks_is_refused(tiny_config: TinyConfig) -> None:
    with pytest.raises(ConfigError, match="--budget 1GiB: resnet32 has no reversible blocks, so there is nothing to plan"):
        Trainer(tiny_config(model="resnet32", budget="1GiB"))


def test_plan_for_another_batch_size_warns(tiny_config: TinyConfig, tmp_path: Path) -> None:
    plan = _plan_for("revnet38", c_blocks=0)
    plan.batch_size = 128
    plan.to_json(tmp_path / "plan.json")
    out = io.StringIO()
    Trainer(tiny_config(plan=str(tmp_path / "plan.json")), out=out)
    assert "warning: the plan was solved for batch size 128 (this run: 16)" in out.getvalue()
