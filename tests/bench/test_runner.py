"""The runner and the report schema: one header, md + csv (+ json), names by device, clear errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from revtrain.bench import BenchOptions, Column, Report, Table, write_report
from revtrain.bench.report import render_markdown
from revtrain.bench.runner import SUITES, device_label, run_suite, suite_module
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
