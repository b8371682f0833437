"""The ``revtrain`` command: parse options, build objects, run them.

    revtrain train [options]      train a model (default: RevNet-38 on digits, M-mode)
    revtrain models [pattern]     the model zoo with parameter counts
    revtrain sample --checkpoint  continue a text prompt with a trained language model
    revtrain export RUN --out D   write a run's model as model.safetensors + model.json
    revtrain plan [options]       choose M/C per reversible block for a memory budget
    revtrain bench SUITE          a benchmark suite (core, zoo, planner, petra, ...): results/ report

Options of ``train`` and ``plan`` are the fields of their config dataclasses, with
the fields' docstrings as help (:mod:`revtrain.options`). Errors in what the user asked for (an unknown model, a missing
dataset folder, a bad checkpoint, an impossible budget) print one message and exit with 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from revtrain._version import __version__
from revtrain.errors import RevtrainError
from revtrain.options import add_config_options as _add_config_options
from revtrain.options import given_options as _given

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``revtrain`` command line; returns the exit status."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what the ranks of a multi-process run are started with
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("revtrain: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RevtrainError, ValueError, OSError, ImportError) as err:
        if os.environ.get("REVTRAIN_DEBUG"):
            raise
        print(f"revtrain {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="revtrain", description="Train reversible neural networks fast and in little memory.",
        epilog="Set REVTRAIN_DEBUG=1 to see the traceback behind an error message.",
    )
    parser.add_argument("--version", action="version", version=f"revtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from revtrain.models import list_models
    from revtrain.tasks import list_tasks
    from revtrain.train import TrainConfig

    train = sub.add_parser("train", help="train a model (default: RevNet-38 on digits, M-mode)",
                           description="Train a model; every option defaults to the recipe in TrainConfig.")
    from revtrain.planner.profile_options import PROFILE_OPTIONS, ProfileOptions

    _add_config_options(train, TrainConfig, const={"amp": "bf16"}, help_suffix={
        "model": f" Choices: {', '.join(list_models())}.",
        "task": f" Choices: {', '.join(list_tasks())}.",
    }, exclude=PROFILE_OPTIONS)
    # --repeats, --refine, --t-e-max-pairs, ...: the same options as revtrain plan's, one definition
    _add_config_options(train.add_argument_group("planning (with --budget)"), ProfileOptions)
    train.add_argument("--config", metavar="FILE", default=None,
                       help="read options from a .toml or .json file (a run's config.json works); options "
                            "given on the command line override it (revtrain.train.config_file)")
    train.set_defaults(run=_run_train)

    from revtrain.train.sample import SampleConfig

    sample = sub.add_parser("sample", help="continue a text prompt with a trained language model",
                            description="Generate bytes with the model of a `revtrain train --dataset text` run.")
    _add_config_options(sample, SampleConfig)
    sample.set_defaults(run=_run_sample)

    export = sub.add_parser("export", help="write a run's model as model.safetensors + model.json",
                            description="Export the trained model of a run folder (or checkpoint) to safetensors; "
                                        "revtrain.load(folder) rebuilds it.")
    export.add_argument("source", metavar="RUN", help="run folder or checkpoint.pt")
    export.add_argument("--out", required=True, help="folder to write model.safetensors and model.json into")
    export.add_argument("--overwrite", action="store_true", help="replace an export already in --out")
    export.set_defaults(run=_run_export)

    models = sub.add_parser("models", help="list the model zoo with parameter counts")
    models.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'revnet*'")
    models.set_defaults(run=_run_models)

    plan = sub.add_parser("plan", help="choose M/C mode per reversible block for a memory budget",
                          description="Profile a zoo model, plan for a memory budget, measure the plan.")
    _wire_plan(plan)

    bench = sub.add_parser("bench", help="run a benchmark suite and write its report (revtrain bench --help)")
    _wire_bench(bench)
    return parser


# ----------------------------------------------------------------------------- commands


def _run_train(args: argparse.Namespace) -> int:
    from revtrain.parallel.command import run_parallel, single_process_engine
    from revtrain.train import TrainConfig, Trainer, TrainingInterrupted, resolve_run
    from revtrain.train.config_file import merge_with_file

    given = merge_with_file(args.config, TrainConfig, _given(args, TrainConfig))
    resumed = resolve_run(dict(given)) if given.get("resume") is not None else None  # its checkpoint is read once
    status = run_parallel(args.argv, given, resumed)
    if status is not None:
        return status
    run = resumed if resumed is not None else resolve_run(given)
    trainer = Trainer(run, engine=single_process_engine(run.config))
    try:
        trainer.fit()
    except TrainingInterrupted as stop:  # the checkpoint is saved and the trainer said where
        return 128 + stop.signum
    return 0


def _run_sample(args: argparse.Namespace) -> int:
    from revtrain.train.sample import SampleConfig, sample_from_checkpoint

    print(sample_from_checkpoint(SampleConfig(**_given(args, SampleConfig))))
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from revtrain.train.export import export

    print(f"wrote {export(args.source, args.out, overwrite=args.overwrite)}/model.safetensors and model.json")
    return 0


def _run_models(args: argparse.Namespace) -> int:
    from revtrain.models import count_params, list_models, model_info

    names = list_models(args.pattern)
    if not names:
        raise ValueError(f"no model matches {args.pattern!r}; run `revtrain models` for the full list")
    rows = [("model", "kind", "dataset", "params", "paper", "description")]
    for name in names:
        info = model_info(name)
        paper = f"{info.paper_params / 1e6:.2f}M" if info.paper_params else "-"
        kind = "reversible" if info.reversible else "plain"
        rows.append((name, kind, f"{info.dataset} ({info.num_classes})", f"{count_params(name) / 1e6:.2f}M",
                     paper, info.description))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) if i in (0, 1, 2) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths, strict=False))) + "  " + row[5])
    return 0


def _wire_bench(parser: argparse.ArgumentParser) -> None:
    from revtrain.bench import runner

    runner.add_arguments(parser)
    parser.set_defaults(run=lambda args: runner.main(args, argv=args.argv[args.argv.index("bench") + 1:]))


def _wire_plan(parser: argparse.ArgumentParser) -> None:
    from revtrain.planner.command import PlanConfig, run_plan
    from revtrain.planner.profile_options import PROFILE_OPTIONS, ProfileOptions

    _add_config_options(parser, PlanConfig, exclude=PROFILE_OPTIONS)
    _add_config_options(parser.add_argument_group("how carefully the planner measures"), ProfileOptions)
    parser.set_defaults(run=lambda args: run_plan(PlanConfig(**_given(args, PlanConfig))))


if __name__ == "__main__":
    sys.exit(main())
