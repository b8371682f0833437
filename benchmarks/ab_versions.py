"""Two versions of revtrain in one process: the working tree against a git revision, to a percent.

A change that moves an M-mode step by a percent or two cannot be seen by timing the two versions
in separate processes on a shared machine: a step's time drifts by tens of percent between runs
(and ratios to the peers by a few percent). Here both versions run in the same process. The
revision ``--base`` is exported (``git archive``) into a temporary folder as the package
``revtrain_base``, its imports rewritten; the stack benchmark's model for ``--method`` is built by
each version (``revtrain.bench.stack.stack_setup``: same seed, same weights, same batch), and every
round times one step of each, the order swapping every round. The median of the per-round ratios
new / base comes with a distribution-free interval (``revtrain.timing.median_interval``).
Construction order can bias the ratio by about half a percent; ``--order nb`` builds the working
tree's model first: run both orders. Both versions' gradients are compared before timing.
Writes ``results/ab_versions_<shape>_<method>_<base>.md`` and ``.json``.

    python benchmarks/ab_versions.py --base 2b0f794 --shape 8x16x8x16 --rounds 600
    python benchmarks/ab_versions.py --base HEAD~3 --method M-nocheck --order nb
    python benchmarks/ab_versions.py --base-dir .ab/base --device cuda --shape 32x64x32x16  # no git there
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the working tree's revtrain, whatever is installed

import revtrain  # noqa: E402
from revtrain.bench import machine_info  # noqa: E402
from revtrain.bench.results import write_result  # noqa: E402
from revtrain.bench.stack import (  # noqa: E402
    EXTRA_METHODS, OURS, _gradients, _rel_err, _timed_step, parse_stack_shape, stack_setup,
)
from revtrain.device import resolve_device  # noqa: E402
from revtrain.timing import median_interval  # noqa: E402

BASE_PACKAGE = "revtrain_base"
"""The name the exported revision is imported under."""

_IMPORTS = re.compile(r"^(\s*)(from|import) revtrain(?=[.\s]|$)", re.MULTILINE)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="git revision to compare against (a hash, HEAD~1, a tag)")
    base.add_argument("--base-dir", type=Path, help="a folder holding an exported revtrain/ (for a machine without "
                      "the git history: git archive REV revtrain | tar -x -C DIR; echo REV > DIR/REVISION)")
    parser.add_argument("--shape", default="8x16x8x16", help="BATCHxCHANNELSxSIZExDEPTH")
    parser.add_argument("--method", default="M", help=f"one of revtrain's methods: {', '.join((*OURS, *EXTRA_METHODS))}")
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--order", choices=("bn", "nb"), default="bn",
                        help="which model is built first: base then new (bn) or new then base (nb)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... or auto")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def export_base(revision: str, into: Path) -> str:
    """Export ``revision``'s ``revtrain/`` into ``into`` as :data:`BASE_PACKAGE`; returns the
    revision's short hash. Raises SystemExit with the reason when git cannot."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{revision}^{{commit}}"],
                                check=True, capture_output=True, text=True).stdout.strip()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "revtrain"],
                                 check=True, capture_output=True).stdout
    except FileNotFoundError:
        raise SystemExit("--base needs git on the PATH and a git checkout of revtrain") from None
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"--base {revision!r}: git says: {err.stderr.strip() if err.stderr else err}") from None
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        try:
            tar.extractall(into, filter="data")
        except TypeError:  # Python before 3.10.12 and 3.11.4 has no extraction filters
            tar.extractall(into)
    package = into / BASE_PACKAGE
    (into / "revtrain").rename(package)
    _rewrite_imports(package)
    return commit


def copy_base(folder: Path, into: Path) -> str:
    """Copy ``folder/revtrain`` into ``into`` as :data:`BASE_PACKAGE`; returns its label (the
    revision in ``folder/REVISION``, else the folder's name)."""
    source = folder / "revtrain"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"--base-dir {folder}: no revtrain/ package there (export one with "
                         f"git archive REV revtrain | tar -x -C {folder})")
    shutil.copytree(source, into / BASE_PACKAGE)
    _rewrite_imports(into / BASE_PACKAGE)
    revision = folder / "REVISION"
    return revision.read_text().strip() if revision.is_file() else folder.resolve().name


def _rewrite_imports(package: Path) -> None:
    for path in package.rglob("*.py"):
        path.write_text(_IMPORTS.sub(rf"\1\2 {BASE_PACKAGE}", path.read_text()))


def build(stack_module, shape: tuple[int, int, int, int], method: str, device: torch.device):
    """One version's model for ``method``, its input and its parameters (the stack benchmark's)."""
    batch, channels, size, depth = shape
    config = stack_module.StackBenchConfig(batch=batch, channels=channels, size=size, depths=(depth,),
                                           methods=("plain", method), device=str(device))
    models, x, params = stack_module.stack_setup(depth, config, device)
    return models[method], x, params


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(revtrain.__file__).resolve().is_relative_to(ROOT):
        raise SystemExit(f"the revtrain imported is {Path(revtrain.__file__).parent}, not this working tree's "
                         f"({ROOT / 'revtrain'}): the 'new' side would not be the working tree. Run with "
                         f"PYTHONPATH={ROOT}")
    try:
        shape = parse_stack_shape(args.shape)
    except ValueError as e:
        raise SystemExit(f"--shape: {e}") from None
    if args.method not in (*OURS, *EXTRA_METHODS):
        raise SystemExit(f"--method {args.method!r}: use one of revtrain's methods, {', '.join((*OURS, *EXTRA_METHODS))}")
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"--device: {e}") from None
    with tempfile.TemporaryDirectory(prefix="revtrain_ab_") as tmp:
        commit = export_base(args.base, Path(tmp)) if args.base else copy_base(args.base_dir, Path(tmp))
        for name in [m for m in sys.modules if m == BASE_PACKAGE or m.startswith(BASE_PACKAGE + ".")]:
            del sys.modules[name]  # an earlier call's export (another revision, a deleted folder)
        sys.path.insert(0, tmp)
        try:
            base_stack = importlib.import_module(f"{BASE_PACKAGE}.bench.stack")
        except Exception as err:  # an old revision may lack the stack benchmark or this method
            raise SystemExit(f"base {commit}: cannot import its stack benchmark: {err}") from None
        finally:
            sys.path.remove(tmp)
        new_stack = sys.modules[stack_setup.__module__]
        versions = {"base": base_stack, "new": new_stack}
        built = {}
        for key in ("base", "new") if args.order == "bn" else ("new", "base"):
            try:
                built[key] = build(versions[key], shape, args.method, device)
            except (KeyError, ValueError, AttributeError, TypeError) as err:  # an older stack benchmark
                raise SystemExit(f"{key} ({commit if key == 'base' else 'working tree'}) cannot build {args.method!r}: {err}") from None
        # The same weights and batch: a change meant to be faster must not change the gradients.
        difference = _rel_err(*(_gradients(*built[key]) for key in ("new", "base")))
        for model, x, params in built.values():
            for _ in range(args.warmup):
                _timed_step(model, x, params, device)
        times: dict[str, list[float]] = {"base": [], "new": []}
        before = machine_info(device)
        start = time.perf_counter()
        for r in range(args.rounds):
            for key in ("base", "new") if r % 2 else ("new", "base"):
                model, x, params = built[key]
                times[key].append(_timed_step(model, x, params, device)[0])
        wall = time.perf_counter() - start
        after = machine_info(device)
    ratio = median_interval([a / b for a, b in zip(times["new"], times["base"])])
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(["python", "benchmarks/ab_versions.py", *argv])
    b, c, s, d = shape
    text = "\n".join([
        f"# {args.method}: the working tree against {commit}, batch {b}, {c} channels, {s}×{s}, depth {d}",
        "",
        "Both versions in one process (the base exported with `git archive`, imported as "
        f"`{BASE_PACKAGE}`), one step of each per round, the order swapping every round; the ratio is the "
        f"median of the per-round ratios new / base with the interval holding the true median with "
        f"probability {ratio.coverage:.1%} (`revtrain.timing.median_interval`).",
        "",
        f"- command: `{command}`",
        f"- device: {before['device']} ({before.get('gpu', before['cpu'])}), torch {before['torch']}, {before['torch_threads']} threads",
        f"- date: {before['date']}; {args.rounds} rounds, wall {wall:.0f} s; built {'base first' if args.order == 'bn' else 'new first'}; "
        f"load average before {before['load_average']}, after {after['load_average']}",
        f"- gradients of the two versions: relative L2 difference {difference:.2e}",
        "",
        "| version | median step | new / base |",
        "|:---|---:|---|",
        f"| base ({commit}) | {statistics.median(times['base']) * 1e3:.3f} ms | – |",
        f"| new (working tree) | {statistics.median(times['new']) * 1e3:.3f} ms | "
        f"{ratio.median:.4f} [{ratio.low:.4f}, {ratio.high:.4f}] |",
    ]) + "\n"
    print(text)
    out = args.out if args.out is not None else ROOT / "results" / f"ab_versions_{args.shape}_{args.method}_{commit}"
    write_result(out, text, {
        "command": command, "base": commit, "method": args.method, "shape": shape, "order": args.order,
        "machine": before, "machine_after": after, "wall_s": wall, "rounds": args.rounds,
        "gradient_difference": difference, "ratio": ratio._asdict(), "times_s": times})
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
