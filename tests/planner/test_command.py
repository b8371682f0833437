"""``revtrain plan`` as the CLI runs it: report, files, and clean errors with exit code 2."""

from __future__ import annotations

import argparse
import io
import types

import pytest

from revtrain.planner import Plan, SweepResult
from revtrain.planner.command import add_plan_arguments, run_plan

from .helpers import PNG_SIGNATURE, TinyRevNet

models = pytest.importorskip("revtrain.models")


@pytest.fixture
def tiny_zoo(monkeypatch):
    """The registry's entry points answer 'tiny' with the tests' small RevNet."""
    real_info = models.model_info

    def model_info(name):
        if name == "tiny":
            return types.SimpleNamespace(input_size=(3, 12, 12), num_classes=10)
        return real_info(name)

    def create_model(name, **overrides):
        assert name == "tiny" and overrides == {"num_classes": 10, "in_channels": 3}
        return TinyRevNet()

    monkeypatch.setattr(models, "model_info", model_info)
    monkeypatch.setattr(models, "create_model", create_model)


def run(*argv: str) -> tuple[int, str, str]:
    args = add_plan_arguments(argparse.ArgumentParser(prog="revtrain plan")).parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    code = run_plan(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


FAST = ("--repeats", "1", "--warmup", "1")


def test_plan_prints_the_report_and_writes_plan_and_figures(tiny_zoo, tmp_path):
    code, out, err = run(
        "--model", "tiny", "--batch-size", "8", "--budget", "500KiB", "--device", "cpu",
        "--out", str(tmp_path / "plan.json"), "--sweep", "4", "--confirm", "1", "--refine", "1",
        "--plots-dir", str(tmp_path / "figs"), *FAST,
    )
    assert code == 0, err
    for words in ("t_e ms", "m_i (tracker)", "pred step s", "meas peak", "plan ", "baseline-M", "best batch size"):
        assert words in out
    assert "baseline-C   does not fit the budget" in out  # its peak is ~549 KiB at batch 8
    plan = Plan.from_json(tmp_path / "plan.json")
    assert plan.model == "tiny" and plan.batch_size == 8 and len(plan.modes) == 5
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes
    for name in ("plan_heatmap.png", "plan_step_times.png"):
        assert (tmp_path / "figs" / name).read_bytes()[:8] == PNG_SIGNATURE
    assert SweepResult.from_json(tmp_path / "figs" / "plan_sweep.json").block_names == list(plan.modes)


def test_impossible_budget_says_what_fits_and_exits_2(tiny_zoo, tmp_path):
    code, out, err = run("--model", "tiny", "--batch-size", "8", "--budget", "200KiB", "--device", "cpu",
                         "--out", str(tmp_path / "plan.json"), *FAST)
    assert code == 2
    assert err.startswith("error: budget 200.00 KiB is below")
    # The baseline-M peak is ~57 KiB fixed + ~47 KiB per sample here: batch 3 fits.
    assert "the largest batch size that fits is about 3" in err
    assert "Traceback" not in err + out
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("--model", "tiny", "--budget", "1.5"), "fraction"),
        (("--model", "tiny", "--budget", "5 parsecs"), "unknown unit"),
        (("--model", "tiny", "--input-shape", "3,x"), "--input-shape"),
        (("--model", "tiny", "--batch-size", "0"), "--batch-size"),
        (("--model", "no_such_model",), "unknown model"),
    ],
)
def test_bad_requests_exit_2_with_one_line(tiny_zoo, argv, words):
    code, out, err = run(*argv, "--device", "cpu")
    assert code == 2
    assert words in err and "Traceback" not in err
