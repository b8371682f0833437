"""``revtrain train --config FILE`` (issue 24 §3): TOML or JSON, the command line overrides the file,
the run folder records the resolved config, and a run's own config.json is loadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from revtrain.cli import main
from revtrain.train import ConfigError, TrainConfig, load_checkpoint
from revtrain.train.config_file import merge_with_file

TINY = ["--device", "cpu", "--quiet", "--no-memory-report"]


def test_toml_file_with_a_command_line_override(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('optimizer = "adamw"\nlr = 3e-3\nbatch-size = 16\nepochs = 3\nmax_steps_per_epoch = 2\n'
                      'milestones = [0.25, 0.5]\nimage_size = 8\n')
    run = tmp_path / "run"
    assert main(["train", "--config", str(recipe), "--epochs", "1", "--run-dir", str(run), *TINY]) == 0
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["optimizer"] == "adamw" and recorded["lr"] == 3e-3 and recorded["batch_size"] == 16
    assert recorded["epochs"] == 1  # the command line wins
    assert recorded["milestones"] == [0.25, 0.5]
    assert load_checkpoint(run / "checkpoint.pt")["progress"]["step"] == 2
    # The run's own config.json is a config file: the same recipe again, in another folder.
    again = tmp_path / "again"
    assert main(["train", "--config", str(run / "config.json"), "--run-dir", str(again), "--quiet"]) == 0
    replayed = json.loads((again / "config.json").read_text())
    assert {k: v for k, v in replayed.items() if k != "run_dir"} == {k: v for k, v in recorded.items()
                                                                     if k != "run_dir"}


def test_a_runs_config_json_points_at_its_own_folder_which_is_refused(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--max-steps-per-epoch", "1", "--batch-size", "16", "--run-dir",
                 str(run), *TINY]) == 0
    assert main(["train", "--config", str(run / "config.json")]) == 2
    assert f"--run-dir {run} already holds a run" in capsys.readouterr().err


def test_resume_and_overwrite_are_not_read_from_a_file(tmp_path: Path) -> None:
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"epochs": 2, "resume": "runs/x", "overwrite": True}))
    notes: list[str] = []
    given = merge_with_file(recipe, TrainConfig, {}, log=notes.append)
    assert given == {"epochs": 2}
    assert notes and "resume, overwrite not read from a file" in notes[0]


@pytest.mark.parametrize(("text", "suffix", "message"), [
    ("epochs = 'ten'\n", ".toml", "epochs = 'ten' is not an integer"),
    ("mode = 'X'\n", ".toml", "mode = 'X' is not one of 'M', 'C'"),
    ("budget = 9000000\n", ".toml", 'budget = 9000000 is not a string or null .unset.; quote it: budget = "9000000"'),
    ("batchsize = 3\n", ".toml", "unknown option.s. batchsize .did you mean batch_size"),
    ("epochs = \n", ".toml", "invalid TOML"),
    ('{"epochs": 2,}', ".json", "invalid JSON at line 1"),
    ("[1, 2]", ".json", "holds a JSON list"),
    ("[data]\nx = 1\n", ".toml", "options go at the top level"),
    ("epochs: 2\n", ".yaml", "unknown format '.yaml'; use a .toml or .json file"),
])
def test_bad_files_name_the_file_and_the_problem(tmp_path: Path, text: str, suffix: str, message: str) -> None:
    path = tmp_path / f"recipe{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"--config {path}:? .*{message}"):
        merge_with_file(path, TrainConfig, {})


def test_process_options_from_a_file_are_run_options(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("data_parallel = 2\nlr = 0.05\nepochs = 1\n")
    given = merge_with_file(path, TrainConfig, {"epochs": 3})
    assert given == {"data_parallel": 2, "lr": 0.05, "epochs": 3}
    assert TrainConfig(**given).data_parallel == 2


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert f"--config {tmp_path / 'nope.toml'} does not exist" in capsys.readouterr().err


def test_the_shipped_recipe_is_valid() -> None:
    recipe = Path(__file__).parents[2] / "configs" / "digits-adamw.toml"
    given = merge_with_file(recipe, TrainConfig, {})
    assert TrainConfig(**given).optimizer == "adamw"


def test_a_runs_summary_given_as_config_points_to_its_config_json(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": 6, "this_process": {"steps": 6}}))
    with pytest.raises(ConfigError, match=f"a run's options are in its config.json .{tmp_path / 'config.json'}"):
        merge_with_file(summary, TrainConfig, {})
