"""benchmarks/check_parts.py times the check's parts inside steps and puts the functions back
(a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import revtrain.core.checks as checks
import revtrain.core.fingerprint as fingerprint

from .scripts import load_benchmark


def test_parts_are_timed_only_where_layers_check_and_the_functions_are_restored(tmp_path: Path) -> None:
    script = load_benchmark("check_parts")
    originals = [getattr(owner, name) for owner, name, _ in script.PARTS] + [checks._all_within]
    out = tmp_path / "parts"
    assert script.main(["--batch", "4", "--checked", "none", "2", "all", "--steps", "2", "--warmup", "1",
                        "--out", str(out)]) == 0
    assert [getattr(owner, name) for owner, name, _ in script.PARTS] + [checks._all_within] == originals
    assert fingerprint.Fingerprints.add is originals[0]
    rows = {row["checked"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert (rows["none"]["layers_checked"], rows["2"]["layers_checked"], rows["all"]["layers_checked"]) == (0, 1, 7)
    assert all(v == 0 for v in rows["none"]["parts_us"].values())
    assert all(v > 0 for v in rows["all"]["parts_us"].values())
    labels = [label for _, _, label in script.PARTS]
    assert len(set(labels)) == len(labels)


@pytest.mark.parametrize(("argv", "words"), [(["--checked", "some"], "layer index"), (["--checked", "99", "--batch", "2"], "reversible layers"),
                                             (["--model", "resnet32"], "no reversible layers"), (["--model", "revformer_tiny"], "takes tokens")])
def test_bad_requests_are_refused(argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit, match=words):
        load_benchmark("check_parts").main(argv)
