"""A --quick smoke run of every suite, smaller still where a suite allows: complete rows, sane
memory order where it is deterministic, files written. No timing is asserted."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from revtrain.bench import OURS, BenchOptions, installed_peers, run_suite
from revtrain.core.checks import FIRST_CHECKS
from revtrain.bench.suites import compile as compile_suite


def _run(name: str, tmp_path: Path, **options):
    report, paths = run_suite(name, BenchOptions(quick=True, device="cpu", out=str(tmp_path / name), **options),
                              log=lambda _: None)
    assert [p.name for p in paths] == [f"{name}.md", f"{name}.csv"]
    with paths[1].open() as f:
        assert len(list(csv.DictReader(f))) == sum(len(t.rows) for t in report.tables)
    return report


def test_core(tmp_path: Path) -> None:
    report = _run("core", tmp_path, shapes=("2x8x4x2",), repeats=3, warmup=FIRST_CHECKS)  # past the default check window
    methods = [*OURS, *installed_peers()]
    steps = report.table("steps").rows
    assert [r["method"] for r in steps] == methods
    for r in steps:
        assert r["time_x_plain_low"] <= r["time_x_plain"] <= r["time_x_plain_high"] and r["rounds"] == 3
        assert r["peak_bytes"] > 0
    by = {r["method"]: r for r in steps}
    assert by["M"]["peak_bytes"] < by["plain"]["peak_bytes"]  # activations rebuilt, not kept
    versus = report.table("m_versus").rows
    assert [r["versus"] for r in versus] == [m for m in methods if m != "M"]
    assert all(r["verdict"] in ("faster", "slower", "no difference shown") for r in versus)


def test_core_runs_exactly_the_methods_named(tmp_path: Path) -> None:
    report = _run("core", tmp_path, shapes=("2x8x4x2",), methods=("C", "M"), repeats=2, warmup=0)
    assert [r["method"] for r in report.table("steps").rows] == ["plain", "C", "M"]  # no peer added
    assert [r["versus"] for r in report.table("m_versus").rows] == ["plain", "C"]
    report = _run("core", tmp_path, shapes=("2x8x4x2",), methods=("plain", "checkpoint"), repeats=2, warmup=0)
    assert [r["method"] for r in report.table("steps").rows] == ["plain", "checkpoint"]
    assert report.table("m_versus").rows == []  # nothing to put M-mode against


def test_zoo(tmp_path: Path) -> None:
    report = _run("zoo", tmp_path, models=("revnet38",), shapes=("8:4",), repeats=1, warmup=1)
    (row,) = report.table("steps").rows
    assert (row["model"], row["twin"], row["input"], row["batch"]) == ("revnet38", "resnet32", "8×8", 4)
    assert all(row[k] > 0 for k in ("M_step_s", "C_step_s", "twin_step_s", "M_over_C"))
    assert 0 < row["M_peak_bytes"] < row["C_peak_bytes"]
    (phase,) = report.table("phases").rows
    assert 0 < phase["C_blocks_s"] < phase["C_forward_s"]  # the stem, head and loss run outside the blocks
    # Ratios of wall-clock times: only their sign is asserted (a busy machine moves the values).
    assert math.isfinite(phase["floor"]) and phase["floor"] > 1
    assert math.isfinite(phase["floor_graph"]) and phase["floor_graph"] > 1


def test_planner(tmp_path: Path) -> None:
    report = _run("planner", tmp_path)
    plans = report.table("plan").rows
    assert [r["batch"] for r in plans] == [2, 4]
    for r in plans:
        assert r["plan_peak_bytes"] <= r["budget_bytes"] and r["C_blocks"] <= r["blocks"]
    assert len(report.table("settings").rows) == 4 * len(plans)
    assert any("within the budget" in n for n in report.notes)
    assert [t.name for t in report.tables][3:] == ["whole_model", "whole_model_settings", "whole_model_layers"]


def test_planner_whole_model_alone_writes_its_own_report(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    report, paths = run_suite("planner", BenchOptions(quick=True, device="cpu", methods=("whole-model",)),
                              log=lambda _: None)
    assert [str(p) for p in paths] == ["results/tmp/planner_cpu_whole_model.md", "results/tmp/planner_cpu_whole_model.csv"]
    assert [t.name for t in report.tables] == ["whole_model", "whole_model_settings", "whole_model_layers"]
    rows = report.table("whole_model").rows
    budgets = [r["budget_bytes"] for r in rows]
    assert budgets == sorted(budgets, reverse=True) and rows[0]["c_fits"] == "yes" and rows[-1]["c_fits"] == "no"
    for r in rows:
        # Every option finds a plan at every budget down to the smallest, and its measured step
        # memory keeps within the budget; M/C alone has none below all-M's step memory.
        assert r["new_plan"] != "infeasible" and r["new_peak_bytes"] <= r["budget_bytes"]
        assert (r["mc_plan"] == "infeasible") == (r["vs_all_M"] < 0)
        if r["mc_plan"] != "infeasible":
            assert r["mc_peak_bytes"] <= r["budget_bytes"]
            assert r["new_over_mc_low"] <= r["new_over_mc"] <= r["new_over_mc_high"]
    assert rows[-1]["b_fits"] == "yes"  # the smallest budget is checkpointing's step memory
    assert {r["layer"] for r in report.table("whole_model_layers").rows} >= {"stem"}


def test_planner_parts_are_checked() -> None:
    with pytest.raises(ValueError, match="parts .--methods. are sweep, whole-model; got fast"):
        run_suite("planner", BenchOptions(quick=True, device="cpu", methods=("fast",)), log=lambda _: None)


def test_transformer(tmp_path: Path) -> None:
    report = _run("transformer", tmp_path, shapes=("16",), repeats=1, warmup=0)
    depth = {(r["depth"], r["method"]): r for r in report.table("depth").rows}
    assert depth[2, "M"]["kept_bytes"] < depth[2, "plain"]["kept_bytes"]
    assert {r["method"] for r in report.table("seq_len").rows} >= {"plain", "checkpoint", "C", "M", "M-chunked"}


def test_inplace_abn(tmp_path: Path) -> None:
    report = _run("inplace_abn", tmp_path, repeats=1, warmup=0)
    rows = report.table("steps").rows
    assert [r["method"] for r in rows] == ["iabn M", "iabn M (recompute)", "iabn C", "plain", "plain, in-place"]
    assert all(r["grad_rel_error"] <= 1e-9 and r["peak_bytes"] > 0 for r in rows)  # float64 gradients


def test_train(tmp_path: Path) -> None:
    (row,) = _run("train", tmp_path).table("runs").rows
    assert row["run"] == "digits-revnet38" and row["metric"] == "test acc"
    assert 0 <= row["value"] <= 1 and 0 < row["step_peak_bytes"] < row["plain_backprop_peak_bytes"]


@pytest.mark.multiprocess
def test_petra(tmp_path: Path) -> None:
    report = _run("petra", tmp_path)
    assert [r["run"] for r in report.table("accuracy").rows] == ["backprop (J=1)", "PETRA J=2"]
    stages = report.table("stages").rows
    assert [(r["run"], r["stage"]) for r in stages] == [("backprop (J=1)", 0), ("PETRA J=2", 0), ("PETRA J=2", 1)]


@pytest.mark.multiprocess
def test_petra_rank_exit_alone(tmp_path: Path) -> None:
    report = _run("petra", tmp_path, methods=("rank-exit",), repeats=1)
    rows = report.table("rank_exit").rows
    assert [(r["ending"], r["runs"]) for r in rows] == [("exit_rank", 1), ("normal", 1)]
    assert rows[0]["failed"] == 0 and rows[0]["failed_codes"] == "-"  # exit_rank always ends cleanly
    assert [t.name for t in report.tables] == ["rank_exit"] and report.title.startswith("PETRA's ranks")


@pytest.mark.slow
def test_compile(tmp_path: Path) -> None:
    """The --quick smoke run, for real: two fresh `revtrain train` processes, eager then compiled
    (~45 s on 2 cores, nearly all of it inductor compiling the model)."""
    eager, compiled = _run("compile", tmp_path).table("runs").rows
    assert (eager["run"], compiled["run"]) == ("eager", "compiled")
    for row in (eager, compiled):
        assert all(row[k] is not None for k in ("process_wall_s", "epoch1_s", "later_epoch_s", "samples_per_s"))
        assert 0 <= row["test_accuracy"] <= 1
    assert math.isclose(compiled["gain"], eager["later_epoch_s"] / compiled["later_epoch_s"])
    assert math.isclose(compiled["compile_s"], compiled["epoch1_s"] - compiled["later_epoch_s"])


def test_compile_reads_the_gain_and_compilation_time_from_the_two_runs(tmp_path: Path, monkeypatch) -> None:
    """The suite's arithmetic on two runs' metrics (a real compiled run takes minutes on a CPU:
    tests/test_compilation.py checks that compiling works)."""
    runs = {"eager": [4.0, 2.0, 2.2], "compiled": [30.0, 1.0, 1.2]}
    commands = []

    def fake_run(command: str, run_dir: Path, device=None) -> dict:
        commands.append(command)
        epochs = runs["compiled" if "--compile" in command.split() else "eager"]
        records = [{"epoch": i, "epoch_train_time_s": t, "samples_per_s": 100 / t, "test_acc": 0.5} for i, t in enumerate(epochs)]
        return {"records": records, "wall_s": sum(epochs), "summary": {}, "tail": []}

    monkeypatch.setattr(compile_suite, "train_run", fake_run)
    report = _run("compile", tmp_path)
    eager, compiled = report.table("runs").rows
    assert commands[0].endswith("--no-compile") and commands[1].endswith("--compile")
    assert math.isclose(compiled["gain"], 2.1 / 1.1) and math.isclose(compiled["compile_s"], 30.0 - 1.1)
    assert eager["epoch1_s"] == 4.0 and compiled["test_accuracy"] == 0.5


def test_core_parts_merge_by_shape_and_method(tmp_path: Path) -> None:
    """A suite run in parts (--merge), one method per part: every part's rows stay."""
    def part(*methods: str):
        options = BenchOptions(quick=True, device="cpu", out=str(tmp_path / "core"), shapes=("2x8x4x2",),
                               repeats=2, warmup=0, merge=True, methods=methods)
        return run_suite("core", options, log=lambda _: None)[0]

    part("plain", "M")
    report = part("plain", "C")
    assert sorted(r["method"] for r in report.table("steps").rows) == ["C", "M", "plain"]
    assert sorted(r["versus"] for r in report.table("m_versus").rows) == ["plain"]


def test_a_merge_into_another_suites_report_is_refused_before_measuring(tmp_path: Path, monkeypatch) -> None:

    out = str(tmp_path / "report")
    run_suite("core", BenchOptions(quick=True, device="cpu", out=out, shapes=("2x8x4x2",), repeats=2, warmup=0,
                                   methods=("plain", "M"), merge=True), log=lambda _: None)

    def must_not_run(*args, **kwargs):
        raise AssertionError("measured before the merge was checked")

    from revtrain.bench.suites import inplace_abn
    monkeypatch.setattr(inplace_abn, "run", must_not_run)
    with pytest.raises(ValueError, match="cannot merge a report of suite 'inplace_abn' into one of suite 'core'.*"
                                         "nothing was measured"):
        run_suite("inplace_abn", BenchOptions(quick=True, device="cpu", out=out, merge=True), log=lambda _: None)
