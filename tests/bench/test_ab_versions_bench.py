"""benchmarks/ab_versions.py exports a revision, runs both versions and pairs them (a smoke test:
no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _in_git_checkout() -> bool:
    try:
        subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True)
    except (FileNotFoundError, subprocess.CalledProcessError):
        return False
    return True


needs_git = pytest.mark.skipif(not _in_git_checkout(), reason="needs git and a git checkout of revtrain")


@needs_git
def test_head_against_the_working_tree_pairs_every_round(tmp_path: Path) -> None:
    script = load_benchmark("ab_versions")
    out = tmp_path / "ab"
    for order in ("bn", "nb"):  # the second call replaces the first call's exported package
        assert script.main(["--base", "HEAD", "--shape", "2x4x4x1", "--rounds", "4", "--warmup", "1",
                            "--order", order, "--out", str(out)]) == 0
        data = json.loads(out.with_suffix(".json").read_text())
        assert data["order"] == order and len(data["times_s"]["base"]) == len(data["times_s"]["new"]) == 4
        # The same weights and batch through HEAD's code and the working tree's.
        assert data["gradient_difference"] < 1e-5
        ratio = data["ratio"]
        assert ratio["low"] <= ratio["median"] <= ratio["high"]
        assert "new (working tree)" in out.with_suffix(".md").read_text()


@needs_git
def test_an_unknown_revision_is_named() -> None:
    script = load_benchmark("ab_versions")
    with pytest.raises(SystemExit, match="no-such-revision"):
        script.main(["--base", "no-such-revision", "--rounds", "1"])


def test_an_unknown_method_is_named() -> None:
    script = load_benchmark("ab_versions")
    with pytest.raises(SystemExit, match="revlib"):
        script.main(["--base", "HEAD", "--method", "revlib"])


@needs_git
def test_an_exported_folder_serves_as_the_base(tmp_path: Path) -> None:
    """What a GPU machine without the git history uses: ``--base-dir`` with a REVISION file."""
    folder = tmp_path / "base"
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD", "revtrain"],
                             check=True, capture_output=True).stdout
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder)
    (folder / "REVISION").write_text("head-for-test\n")
    script = load_benchmark("ab_versions")
    out = tmp_path / "ab"
    assert script.main(["--base-dir", str(folder), "--shape", "2x4x4x1", "--rounds", "2", "--warmup", "0",
                        "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["base"] == "head-for-test" and data["gradient_difference"] < 1e-5


def test_a_folder_without_revtrain_is_named(tmp_path: Path) -> None:
    script = load_benchmark("ab_versions")
    with pytest.raises(SystemExit, match="no revtrain/ package"):
        script.main(["--base-dir", str(tmp_path)])
