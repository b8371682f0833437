"""``revtrain plan`` as the CLI runs it: report, files, and clean errors with exit code 2."""

from __future__ import annotations

import pytest

from revtrain.cli import main
from revtrain.planner import Plan, SweepResult

from .helpers import PNG_SIGNATURE, TinyRevNet


@pytest.fixture
def tiny_zoo(monkeypatch):
    """The registry answers 'tiny' with the tests' small RevNet on 3x12x12 images."""
    from revtrain.models import ModelInfo, registry
    from revtrain.models.inputs import image_input

    def tiny(num_classes: int = 10, in_channels: int = 3) -> TinyRevNet:
        assert in_channels == 3
        return TinyRevNet(num_classes=num_classes)

    info = ModelInfo(name="tiny", builder=tiny, reversible=True, dataset="synthetic",
                     inputs=image_input(3, 12, 12, 10), paper="")
    monkeypatch.setitem(registry._REGISTRY, "tiny", info)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


FAST = ("--repeats", "1", "--warmup", "1", "--t-e-max-pairs", "5")


def test_plan_prints_the_report_and_writes_plan_and_figures(tiny_zoo, tmp_path, capsys):
    code, out, err = run(
        capsys, "--model", "tiny", "--batch-size", "8", "--budget", "500KiB", "--device", "cpu",
        "--out", str(tmp_path / "plan.json"), "--sweep", "4,8", "--confirm", "2", "--refine", "1",
        "--plots-dir", str(tmp_path / "figs"), *FAST,
    )
    assert code == 0, err
    for words in ("profiling: t_e of each block", "t_e ms", "IQR ms", "pairs", "m_i (tracker)", "pred step s",
                  "meas peak", "plan ", "baseline-M", "best batch size", "step memory (batch 8, "):
        assert words in out, words
    assert "baseline-C   does not fit the budget" in out  # its peak is ~549 KiB at batch 8
    plan = Plan.from_json(tmp_path / "plan.json")
    assert plan.model == "tiny" and plan.batch_size == 8 and len(plan.modes) == 5
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes
    assert f"measured step {plan.measured_step_time_s:.4g} s" in out  # predicted and measured, side by side
    for name in ("plan_heatmap.png", "plan_step_times.png"):
        assert (tmp_path / "figs" / name).read_bytes()[:8] == PNG_SIGNATURE
    sweep = SweepResult.from_json(tmp_path / "figs" / "plan_sweep.json")
    assert sweep.block_names == list(plan.modes)
    # The sweep plans its best sizes with the same pipeline, from the same profile at batch 8:
    # the same plan as plan.json.
    at_8 = sweep.point(8)
    assert at_8.planned and at_8.modes == plan.modes and at_8.predicted_step_time_s == plan.predicted_step_time_s
    from revtrain.planner.command import SWEEP_FILES

    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(SWEEP_FILES)
    # Another sweep into the same --plots-dir (a new --out) replaces nothing unasked, before measuring.
    code, out, err = run(capsys, "--model", "tiny", "--batch-size", "8", "--device", "cpu", "--out",
                         str(tmp_path / "plan2.json"), "--sweep", "4,8", "--plots-dir", str(tmp_path / "figs"), *FAST)
    assert code == 2 and f"--plots-dir {tmp_path / 'figs' / 'plan_heatmap.png'} exists already; nothing was measured" in err
    assert not (tmp_path / "plan2.json").exists()


def test_the_plan_measures_with_the_check_interval_asked(tiny_zoo, tmp_path, capsys, monkeypatch):
    import revtrain.planner.command as command

    seen = []

    def recording_prepare(model, *args, **kwargs):
        from revtrain.core import reversible_blocks

        seen.extend((layer.check_reconstruction, layer.check_every) for _, layer in reversible_blocks(model))
        raise SystemExit(0)  # what was measured is all this test needs

    monkeypatch.setattr(command, "prepare", recording_prepare)
    with pytest.raises(SystemExit):
        run(capsys, "--model", "tiny", "--batch-size", "4", "--device", "cpu", "--check-every", "0",
            "--out", str(tmp_path / "plan.json"), *FAST)
    assert seen and set(seen) == {(False, 1)}


def test_a_transformer_is_planned_and_swept_at_the_sequence_length_asked(tmp_path, capsys):
    # The model is built for the sequence length (context 8) and the vocabulary (64) asked; both
    # the plan and the sweep's figures cover its reversible Transformer blocks.
    code, out, err = run(
        capsys, "--model", "revformer_tiny", "--batch-size", "4", "--input-shape", "8", "--num-classes", "64",
        "--budget", "64MiB", "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "plan.json"),
        "--sweep", "2,4", "--confirm", "1", "--refine", "1", *FAST,
    )
    assert code == 0, err
    assert "revtrain plan: revformer_tiny, batch 4 x 8 tokens" in out and "best batch size" in out
    plan = Plan.from_json(tmp_path / "plan.json")
    assert plan.input_shape == (8,) and plan.batch_size == 4
    assert list(plan.modes) == ["layers.blocks.0", "layers.blocks.1"]
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes
    for name in ("plan_heatmap.png", "plan_step_times.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
    assert SweepResult.from_json(tmp_path / "plan_sweep.json").block_names == list(plan.modes)


def test_in_place_abn_layers_are_planned_from_the_command_line(tmp_path, capsys):
    code, out, err = run(
        capsys, "--model", "resnext29_iabn", "--batch-size", "2", "--input-shape", "3", "8", "8",
        "--budget", "64MiB", "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "plan.json"),
        "--refine", "0", *FAST,
    )
    assert code == 0, err
    plan = Plan.from_json(tmp_path / "plan.json")
    assert plan.input_shape == (3, 8, 8) and len(plan.modes) == 28  # 3 per unit x 9 units + the head's
    assert "stages.0.0.bn1" in plan.modes and "head.bn" in plan.modes
    assert "t_e of stages.0.0.bn1" in out


def test_impossible_budget_says_what_fits_and_exits_2(tiny_zoo, tmp_path, capsys):
    code, out, err = run(capsys, "--model", "tiny", "--batch-size", "8", "--budget", "210KiB", "--device", "cpu",
                         "--out", str(tmp_path / "plan.json"), *FAST)
    assert code == 2
    assert err.startswith("revtrain plan: error: budget 210.00 KiB is below")
    # The baseline-M peak is ~58 KiB fixed + ~33 KiB per sample here: batch 4 fits (4.6).
    assert "the largest batch size that fits is about 4" in err
    assert "Traceback" not in err + out
    assert not (tmp_path / "plan.json").exists()


def test_a_budget_below_the_model_and_batch_is_refused_before_profiling(tiny_zoo, tmp_path, capsys):
    code, out, err = run(capsys, "--model", "tiny", "--batch-size", "8", "--budget", "10KiB", "--device", "cpu",
                         "--out", str(tmp_path / "plan.json"), *FAST)
    assert code == 2 and "refused before profiling" in err
    assert "profiling" not in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("--model", "tiny", "--budget", "1.5"), "fraction"),
        (("--model", "tiny", "--budget", "5 parsecs"), "unknown unit"),
        (("--model", "tiny", "--input-shape", "3", "0", "12"), "input_shape"),
        (("--model", "tiny", "--batch-size", "0"), "batch_size"),
        (("--model", "tiny", "--sweep", "8:4"), "batch sizes"),
        (("--model", "tiny", "--t-e-precision", "0"), "precision"),
        (("--model", "tiny", "--threads", "0"), "threads"),
        (("--model", "tiny", "--check-every", "-1"), "check_every"),
        (("--model", "no_such_model",), "unknown model"),
        (("--model", "my_nets.py:small",), "plan your own model in the run that trains it"),
        (("--model", "tiny", "--out", "/proc/no/plan.json"), "--out /proc/no/plan.json: cannot make its folder"),
        (("--model", "revformer_tiny", "--input-shape", "3", "8", "8"), "must be 1 number(s): a sequence length"),
        (("--model", "resnext29_iabn", "--input-shape", "8"), "must be 3 number(s): sizes like 3 32 32"),
    ],
)
def test_bad_requests_exit_2_with_one_line_before_anything_runs(tiny_zoo, monkeypatch, capsys, argv, words):
    import revtrain.planner.command as command

    def must_not_run(*args, **kwargs):
        raise AssertionError("measured before every option was checked")

    monkeypatch.setattr(command, "prepare", must_not_run)
    code, out, err = run(capsys, *argv, "--device", "cpu")
    assert code == 2
    assert words in err and "Traceback" not in err and err.count("\n") == 1


def test_the_options_come_from_the_config_docstrings(capsys):
    from revtrain.planner.command import PlanConfig
    from revtrain.train import field_docs

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, doc in field_docs(PlanConfig).items():
        assert "--" + name.replace("_", "-") in text
        assert " ".join(doc.split())[:40] in text
    assert "--no-verify" in text and "(default: 128)" in text


class _Stop(Exception):
    """Raised by the spy once it has seen what the planner was asked for."""


def _planner_kwargs(monkeypatch, tmp_path, *options: str) -> dict:
    """What ``revtrain train --budget`` hands the planner (the spy stops the run there)."""
    import revtrain.train.memory_strategy as strategy

    seen: dict = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(strategy, "plan_for_model", spy)
    with pytest.raises(_Stop):
        main(["train", "--model", "revnet38", "--budget", "9MiB", "--device", "cpu", "--epochs", "1", "--quiet",
              "--run-dir", str(tmp_path / "run"), *options])
    return seen


def test_train_budget_profiles_with_the_options_plan_has_one_definition_one_default(monkeypatch, tmp_path):
    from revtrain.planner.command import PlanConfig
    from revtrain.planner.profile_options import PROFILE_OPTIONS, ProfileOptions
    from revtrain.train import TrainConfig

    assert issubclass(TrainConfig, ProfileOptions) and issubclass(PlanConfig, ProfileOptions)
    default = _planner_kwargs(monkeypatch, tmp_path)
    plan_default = PlanConfig(model="revnet38")
    assert default["timing"] == plan_default.timing_rule() and default["timing"].max_pairs == 5
    assert (default["refine"], default["repeats"], default["max_repeats"]) == (plan_default.refine, 3, None)
    given = _planner_kwargs(monkeypatch, tmp_path / "b", "--t-e-max-pairs", "2", "--t-e-precision", "0.2",
                            "--refine", "0", "--repeats", "2", "--max-repeats", "4")
    assert (given["timing"].max_pairs, given["timing"].precision) == (2, 0.2)
    assert (given["refine"], given["repeats"], given["max_repeats"]) == (0, 2, 4)
    assert set(PROFILE_OPTIONS) == {"repeats", "max_repeats", "refine", "t_e_precision", "t_e_max_pairs"}


@pytest.mark.parametrize(("argv", "words"), [
    (("--t-e-max-pairs", "0"), "t_e_max_pairs (--t-e-max-pairs) must be an integer >= 1, got 0"),
    (("--refine", "-1"), "refine (--refine) must be an integer >= 0, got -1"),
    (("--repeats", "3", "--max-repeats", "2"), "max_repeats (--max-repeats) must be an integer >= 3, got 2"),
    (("--t-e-precision", "1.5"), "t_e_precision (--t-e-precision) must be a fraction between 0 and 1"),
])
def test_bad_profile_options_are_refused_alike_by_plan_and_train(tiny_zoo, tmp_path, capsys, argv, words):
    code, _, err = run(capsys, "--model", "tiny", "--device", "cpu", *argv)
    assert code == 2 and words in err and err.count("\n") == 1
    code = main(["train", "--budget", "9MiB", "--device", "cpu", "--run-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
