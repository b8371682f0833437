"""revtrain.bench.results.write_result: every benchmark's .md and .json, written in one call."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from revtrain.bench.results import write_result


def test_write_result_writes_both_files_in_a_new_folder(tmp_path: Path, capsys) -> None:
    out = tmp_path / "deep" / "r"
    write_result(out, "# t\n", {"a": 1})
    assert out.with_suffix(".md").read_text() == "# t\n"
    assert json.loads(out.with_suffix(".json").read_text()) == {"a": 1}
    assert str(out.with_suffix(".md")) in capsys.readouterr().out


def test_values_json_cannot_hold_are_written_as_text(tmp_path: Path) -> None:
    out = tmp_path / "r"
    write_result(out, "", {"path": tmp_path, "dtype": torch.float32, "device": torch.device("cpu")})
    assert json.loads(out.with_suffix(".json").read_text()) == {
        "path": str(tmp_path), "dtype": "torch.float32", "device": "cpu"}
