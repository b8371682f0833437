"""``revtrain train --grad-angle-every N``: records, a plot, and training left exactly as it was."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from revtrain.cli import main
from revtrain.train import ConfigError, Trainer

from .conftest import TinyConfig, assert_same_training_state


def _records(run_dir: str, event: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def test_every_second_step_is_measured_plotted_and_changes_nothing(tiny_config: TinyConfig) -> None:
    # 2 epochs x 3 steps: updates 2, 4 and 6 are measured, on their own batches.
    with_monitor = Trainer(tiny_config("angles", grad_angle_every=2), out=(log := io.StringIO()))
    with_monitor.fit()
    without = Trainer(tiny_config("plain"), out=io.StringIO())
    without.fit()
    assert_same_training_state(with_monitor, without)  # bit for bit: the monitor only looks

    records = _records(with_monitor.config.run_dir, "grad_angle")
    assert [r["step"] for r in records] == [2, 4, 6] and [r["epoch"] for r in records] == [0, 1, 1]
    for r in records:
        groups = r["groups"]
        assert "all" in groups and len(groups) > 2  # every parameter, then per top-level module
        # float32 RevNet-38: the rebuild differs from the stored activations by rounding only.
        assert 0 <= groups["all"]["angle_deg"] < 0.1 and groups["all"]["rel_error"] < 1e-2
        assert groups["all"]["angle_deg"] > 0 or groups["all"]["rel_error"] == 0
    assert (Path(with_monitor.config.run_dir) / "grad_angles.png").stat().st_size > 10_000
    text = log.getvalue()
    assert "gradient angle, stored vs rebuilt activations (3 measurements" in text
    assert "grad_angles.png" in text
    assert not _records(without.config.run_dir, "grad_angle")
    assert not (Path(without.config.run_dir) / "grad_angles.png").exists()


def test_a_model_without_reversible_layers_is_refused_before_training(tiny_config: TinyConfig) -> None:
    config = tiny_config("plain_model", model="resnet32", grad_angle_every=1)
    with pytest.raises(ConfigError, match="no reversible layer.*drop the option"):
        Trainer(config, out=io.StringIO())
    assert not Path(config.run_dir).exists()


def test_the_command_line_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--grad-angle-every", "-1", "--run-dir", str(tmp_path / "r")]) == 2
    assert "grad_angle_every must be an integer >= 0" in capsys.readouterr().err
