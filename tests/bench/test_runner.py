"""The runner and the report schema: one header, md + csv (+ json), names by device, clear errors."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from revtrain.bench import BenchOptions, Column, Report, Table, write_report
from revtrain.bench.report import merge_reports, read_report, render_markdown
from revtrain.bench.runner import SUITES, _commit, device_label, run_suite, suite_module
from revtrain.cli import main as cli_main


def _report() -> Report:
    rows = [{"shape": "8x16", "ratio": 1.25, "ratio_low": 1.1, "ratio_high": 1.4, "peak": 2**20, "note": None}]
    table = Table("t", "A table", [Column("shape", "shape"), Column("ratio", "ratio", "interval"),
                                   Column("peak", "peak", "bytes"), Column("note", "note")], rows, note="How to read it.")
    other = Table("u", "Another", [Column("k", "k", "int")], [{"k": 3}])
    header = {"device": "cpu", "device_label": "cpu", "hardware": "x", "torch": "2", "threads": 1, "cpu_count": 2,
              "date": "d", "command": "revtrain bench core", "load_before": (0.1, 0, 0), "load_after": (0.2, 0, 0),
              "wall_s": 3.0}
    return Report("core", "Title", header, [table, other], intro="Intro.", notes=["a note"])


def test_markdown_has_the_header_and_every_table() -> None:
    text = render_markdown(_report())
    assert text.startswith("# Title\n\nIntro.\n")
    for piece in ("command: `revtrain bench core`", "load average before (0.1, 0, 0)", "- a note", "## A table",
                  "How to read it.", "| 8x16 | 1.250 [1.100, 1.400] | 1.00 MiB | – |", "## Another", "| 3 |"):
        assert piece in text, piece
    assert "environment" not in text  # nothing set that changes timings
    report = _report()
    report.header["env"] = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1", "OMP_NUM_THREADS": "1"}
    assert "- environment: `GLIBC_TUNABLES=glibc.malloc.trim_threshold=1`, `OMP_NUM_THREADS=1`" in render_markdown(report)


def test_csv_holds_every_row_of_every_table_and_json_the_header(tmp_path: Path) -> None:
    paths = write_report(_report(), tmp_path / "deep" / "core_cpu", json_too=True)
    assert [p.name for p in paths] == ["core_cpu.md", "core_cpu.csv", "core_cpu.json"]
    with paths[1].open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["suite"], r["device"], r["table"]) for r in rows] == [("core", "cpu", "t"), ("core", "cpu", "u")]
    assert rows[0]["ratio_high"] == "1.4" and rows[1]["k"] == "3" and rows[1]["shape"] == ""
    data = json.loads(paths[2].read_text())
    assert data["header"]["command"] == "revtrain bench core" and data["tables"][1]["rows"] == [{"k": 3}]


def test_device_labels_name_the_gpu() -> None:
    assert device_label({"cpu": "AMD EPYC"}) == "cpu"
    assert device_label({"gpu": "NVIDIA H100 80GB HBM3"}) == "cuda_h100"
    assert device_label({"gpu": "NVIDIA A100-SXM4-40GB"}) == "cuda_a100"


def test_a_report_names_its_commit_and_says_when_the_code_differs_from_it(tmp_path: Path, monkeypatch) -> None:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path counts
    assert _commit(tmp_path) is None  # not a checkout
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "-C", str(tmp_path)]
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "f.py").write_text("a = 1\n")
    (tmp_path / "results.md").write_text("old\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (package / "new_untracked.py").write_text("")
    (tmp_path / "results.md").write_text("new\n")  # a report written by the run itself
    assert _commit(package) == head  # untracked files and files outside the package are not the measured code
    (package / "f.py").write_text("a = 2\n")
    assert _commit(package) == f"{head} with uncommitted changes"


def test_every_suite_is_a_module_with_run() -> None:
    for name in SUITES:
        assert callable(suite_module(name).run), name
    with pytest.raises(ValueError, match="unknown benchmark suite 'nope'; choose from core, zoo"):
        suite_module("nope")


def test_the_header_is_filled_and_a_quick_run_defaults_to_results_tmp(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    report, paths = run_suite("core", BenchOptions(quick=True, shapes=("2x4x4x1",), repeats=2, warmup=0,
                                                  device="cpu"), command="revtrain bench core --quick", log=lambda _: None)
    assert paths[0] == Path("results/tmp/core_cpu.md")
    h = report.header
    for key in ("suite", "device", "hardware", "torch", "threads", "date", "command", "load_before", "load_after", "wall_s"):
        assert h[key] is not None, key
    assert h["suite"] == "core" and h["device_label"] == "cpu" and h["command"].endswith("revtrain bench core --quick")


def test_the_cli_runs_a_suite_and_records_its_command(tmp_path: Path, capsys) -> None:
    out = tmp_path / "c"
    assert cli_main(["bench", "core", "--quick", "--shapes", "2x4x4x1", "--repeats", "2", "--warmup", "0",
                     "--device", "cpu", "--out", str(out)]) == 0
    text = out.with_name("c.md").read_text()
    assert "revtrain bench core --quick --shapes 2x4x4x1 --repeats 2" in text.split("- command: ")[1].splitlines()[0]
    assert f"wrote {out}.md, {out}.csv" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "match"), [
    (["bench", "core", "--repeats", "0"], "--repeats must be at least 1"),
    (["bench", "core", "--shapes", "8x16x8"], "BATCHxCHANNELSxSIZExDEPTH"),
    (["bench", "core", "--methods", "M-fast"], "unknown method"),
    (["bench", "zoo", "--models", "resnet32"], "resnet32 has no reversible layers"),
    (["bench", "all", "--out", "x"], "--out names one report"),
    (["bench", "core", "zoo", "--out", "x"], "--out names one report"),
])
def test_bad_options_are_refused_with_the_fix(argv, match, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    assert match in capsys.readouterr().err


def _part(model: str, value: float, command: str, *, extra_table: bool = False, label: str = "cpu") -> Report:
    rows = [{"model": model, "x": value}]
    tables = [Table("t", "A table", [Column("model", "model"), Column("x", "x", ".1f")], rows, note="n")]
    if extra_table:
        tables.append(Table("u", "Another", [Column("k", "k", "int")], [{"k": 7}]))
    header = {"device": "cpu", "device_label": label, "hardware": "x", "torch": "2", "threads": 1, "cpu_count": 2,
              "date": f"date of {model}", "command": command, "load_before": (0.5, 0, 0), "load_after": (0.6, 0, 0),
              "wall_s": 4.0}
    return Report("planner", "Title", header, tables, notes=[f"note on {model}"], figures=[f"{model}.png"])


def test_merge_replaces_rows_of_the_same_key_and_keeps_the_others(tmp_path: Path) -> None:
    out = tmp_path / "planner_cpu"
    write_report(_part("a", 1.0, "revtrain bench planner --models a", extra_table=True), out, json_too=True)
    merged = merge_reports(read_report(out.with_name("planner_cpu.json")), _part("b", 2.0, "revtrain bench planner --models b"))
    assert [(r["model"], r["x"]) for r in merged.table("t").rows] == [("a", 1.0), ("b", 2.0)]
    assert merged.table("u").rows == [{"k": 7}]  # a table only the first part measured stays
    write_report(merged, out, json_too=True)
    again = merge_reports(read_report(out.with_name("planner_cpu.json")), _part("a", 3.0, "revtrain bench planner --models a"))
    assert [(r["model"], r["x"]) for r in again.table("t").rows] == [("b", 2.0), ("a", 3.0)]
    assert [p["command"] for p in again.header["parts"]] == [f"revtrain bench planner --models {m}" for m in "aba"]
    assert again.notes == ["note on a", "note on b"] and again.figures == ["a.png", "b.png"]
    text = render_markdown(again)
    assert "- measured in 3 parts, merged (`--merge`):" in text
    assert "  - `revtrain bench planner --models b`: date of b; wall 4 s; load average before (0.5, 0, 0)" in text
    assert "| b | 2.0 |" in text and "| a | 3.0 |" in text and "| a | 1.0 |" not in text


def test_a_merged_report_names_each_parts_environment() -> None:
    first, second = _part("a", 1.0, "revtrain bench planner --models a"), _part("b", 2.0, "revtrain bench planner --models b")
    second.header["env"] = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}
    lines = render_markdown(merge_reports(first, second)).splitlines()
    part_a = next(line for line in lines if "--models a`" in line)
    part_b = next(line for line in lines if "--models b`" in line)
    assert "environment" not in part_a
    assert part_b.endswith("; environment `GLIBC_TUNABLES=glibc.malloc.trim_threshold=1`")
    assert not any(line.startswith("- environment") for line in lines)  # not as if every part had it


def test_merge_refuses_another_device_or_an_old_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device 'cuda_h200' into one of device 'cpu'"):
        merge_reports(_part("a", 1.0, "x"), _part("b", 1.0, "y", label="cuda_h200"))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"suite": "planner", "header": {}, "tables": [{"name": "t", "title": "T", "rows": []}]}))
    with pytest.raises(ValueError, match="run the whole suite once without --merge"):
        read_report(old)


def test_the_cli_merges_parts_into_one_report(tmp_path: Path) -> None:
    out = tmp_path / "core_part"
    for shape in ("2x4x4x1", "2x4x4x2"):
        assert cli_main(["bench", "core", "--quick", "--shapes", shape, "--methods", "M", "--repeats", "2",
                         "--warmup", "0", "--device", "cpu", "--out", str(out), "--merge"]) == 0
    report = read_report(out.with_name("core_part.json"))
    assert sorted({r["shape"] for r in report.table("steps").rows}) == ["2x4x4x1", "2x4x4x2"]
    assert len(report.header["parts"]) == 2
    assert "--shapes 2x4x4x2" in report.header["parts"][1]["command"]
    # Both shapes measured again in one part: the report is that part alone.
    assert cli_main(["bench", "core", "--quick", "--shapes", "2x4x4x1", "2x4x4x2", "--methods", "M", "--repeats", "2",
                     "--warmup", "0", "--device", "cpu", "--out", str(out), "--merge"]) == 0
    again = read_report(out.with_name("core_part.json"))
    assert "parts" not in again.header and "--shapes 2x4x4x1 2x4x4x2" in again.header["command"]


def test_a_table_keyed_by_nothing_is_replaced_whole_and_a_key_of_two_columns_by_row(tmp_path: Path) -> None:
    def part(rows: list[dict], key) -> Report:
        columns = [Column("method", "method"), Column("J", "J", "int"), Column("x", "x", ".1f")]
        return Report("petra", "P", {"device_label": "cpu"}, [Table("t", "T", columns, rows, merge_key=key)])

    old = [{"method": "a", "J": 2, "x": 1.0}, {"method": "a", "J": 4, "x": 2.0}, {"method": "b", "J": 2, "x": 3.0}]
    write_report(part(old, ("method", "J")), tmp_path / "p", json_too=True)
    stored = read_report(tmp_path / "p.json")
    assert stored.table("t").merge_key == ("method", "J")
    by_row = merge_reports(stored, part([{"method": "a", "J": 4, "x": 9.0}], ("method", "J")))
    assert [(r["method"], r["J"], r["x"]) for r in by_row.table("t").rows] == [("a", 2, 1.0), ("b", 2, 3.0), ("a", 4, 9.0)]
    whole = merge_reports(stored, part([{"method": "c", "J": 2, "x": 5.0}], ()))
    assert [r["method"] for r in whole.table("t").rows] == ["c"]


def test_a_replaced_models_notes_go_with_its_rows_and_a_complete_remeasurement_stands_alone() -> None:
    old = merge_reports(_part("a", 1.0, "x"), _part("b", 2.0, "y"))
    old.notes += ["a: an old finding on a", "b: an old finding on b"]
    again = merge_reports(old, _part("a", 3.0, "z"))
    assert "a: an old finding on a" not in again.notes  # its rows were measured again
    assert "b: an old finding on b" in again.notes and "note on b" in again.notes
    both = _part("a", 4.0, "w", extra_table=True)
    both.tables[0].rows.append({"model": "b", "x": 5.0})
    fresh = merge_reports(again, both)  # every row the report held, measured again
    assert fresh is both and "parts" not in fresh.header
