"""``revtrain plan``: profile a zoo model, solve for a budget, report predicted and measured costs.

The CLI wires it in with::

    add_plan_arguments(subparsers.add_parser("plan", help=...))  # then: return run_plan(args)

Example::

    revtrain plan --model revnet110 --batch-size 128 --budget 2GiB --out plan.json
    revtrain plan --model revnet38 --budget 50% --sweep 32,64,128,256 --plots-dir plots/

Exit codes: 0 success; 2 a problem with the request (a budget no plan can meet, a malformed
budget, an unknown model), printed as one message without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

import torch

from revtrain.errors import RevtrainError
from revtrain.memory import format_bytes, process_peak_rss_bytes
from revtrain.planner.budget import resolve_budget
from revtrain.planner.measure import measure_steps, resolve_device
from revtrain.planner.plan import BudgetTooSmallError, Plan, Profile
from revtrain.planner.sweep import SweepResult

__all__ = ["add_plan_arguments", "run_plan"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``revtrain plan`` to ``parser``; returns it."""
    parser.add_argument("--model", required=True, help="zoo model name (see `revtrain models`), e.g. revnet110")
    parser.add_argument("--batch-size", type=int, default=128, help="batch size to plan for (default 128)")
    parser.add_argument(
        "--budget", default=None,
        help="peak memory of a training step: bytes, 6GiB, 512MB, a fraction 0.5 or 50%% of the "
        "device's memory (CPU: of available RAM); default all the device can give now",
    )
    parser.add_argument("--input-shape", default=None, help="one sample's shape C,H,W (default: the model's, e.g. 3,32,32)")
    parser.add_argument("--num-classes", type=int, default=None, help="classifier outputs (default: the model's)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="parameter and input dtype")
    parser.add_argument("--out", default="plan.json", help="where to write the plan JSON (default plan.json)")
    parser.add_argument("--profile-out", default=None, help="also write the profile JSON here")
    parser.add_argument(
        "--sweep", default=None,
        help="also sweep batch sizes, '32,64,128,256' or '32:256:32', and plot the plans (paper §3.4)",
    )
    parser.add_argument("--plots-dir", default=None, help="where --sweep writes its PNGs and JSON (default: next to --out)")
    parser.add_argument("--confirm", type=int, default=2, help="--sweep: measure the plans of this many best batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per measurement (medians are used)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions before each measurement")
    parser.add_argument(
        "--refine", type=int, default=4,
        help="measure up to this many richer plans and keep the fastest that fits (0: the plan as solved)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's weights and the synthetic batch")
    parser.add_argument("--no-verify", action="store_true", help="skip checking that every block inverts")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads for torch (default: torch's); 1 gives steadier timings on a shared machine",
    )
    return parser


def run_plan(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``revtrain plan`` with parsed ``args``; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        return _run(args, out)
    except (BudgetTooSmallError, RevtrainError, ValueError) as e:
        print(f"error: {e}", file=err)
        return 2


def _run(args: argparse.Namespace, out: TextIO) -> int:
    from revtrain.models import create_model, model_info
    from revtrain.planner.pipeline import plan_for_model
    from revtrain.planner.profile import profile_model

    info = model_info(args.model)
    shape = _shape(args.input_shape) if args.input_shape else tuple(info.input_size)
    num_classes = args.num_classes or info.num_classes
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    dev = resolve_device(torch.nn.Identity(), args.device)
    budget, explanation = resolve_budget(args.budget, dev)  # fail early on a malformed budget
    dtype = _DTYPES[args.dtype]
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    model = create_model(args.model, num_classes=num_classes, in_channels=shape[0]).to(dev, dtype)
    batch = _synthetic_batch(args.batch_size, shape, num_classes, dtype, dev, args.seed)
    timing = dict(repeats=args.repeats, warmup=args.warmup)

    print(f"revtrain plan: {args.model}, batch {args.batch_size} x {shape}, {args.dtype} on {dev}", file=out)
    print(f"budget: {explanation}", file=out)
    print("profiling (verify, then time and memory of every block) ...", file=out, flush=True)
    if not args.no_verify:
        from revtrain.core import verify_invertible

        verify_invertible(model, batch[0])
    profile = profile_model(model, batch, device=dev, model_name=args.model, **timing)
    if args.profile_out:
        Path(args.profile_out).parent.mkdir(parents=True, exist_ok=True)
        profile.to_json(args.profile_out)
    plan = plan_for_model(
        model, batch, budget, device=dev, verify=False, profile=profile, refine=args.refine, **timing
    )
    plan.budget_source = explanation
    print("measuring the plan and the baselines ...", file=out, flush=True)
    settings: dict[str, str | dict[str, str]] = {"plan": plan.modes, "baseline-M": "M"}
    if _baseline_c_fits(profile, budget):
        settings["baseline-C"] = "C"
    steps = measure_steps(model, batch, settings, device=dev, **timing)  # timed steps alternate
    measured = {name: (m.step_time_s, m.peak_bytes) for name, m in steps.items()}
    plan.measured_step_time_s, plan.measured_peak_bytes = measured["plan"]
    _report(profile, plan, measured, out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        plan.to_json(args.out)
        print(f"wrote {args.out}", file=out)

    if args.sweep:
        from revtrain.planner.plots import write_sweep_plots
        from revtrain.planner.sweep import parse_batch_sizes, sweep_batch_sizes

        sizes = parse_batch_sizes(args.sweep)
        print(f"sweeping batch sizes {sizes} ...", file=out, flush=True)
        result = sweep_batch_sizes(
            model, batch, sizes, budget, confirm=args.confirm, device=dev, verify=False,
            model_name=args.model, **timing,
        )
        result.budget_source = explanation
        _report_sweep(result, out)
        plots_dir = Path(args.plots_dir) if args.plots_dir else Path(args.out or ".").parent
        paths = write_sweep_plots(result, plots_dir)
        result.to_json(plots_dir / "plan_sweep.json")
        for p in [*paths, plots_dir / "plan_sweep.json"]:
            print(f"wrote {p}", file=out)
    return 0


def _baseline_c_fits(profile: Profile, budget: int) -> bool:
    """Whether baseline-C fits: by its measured peak if profiled, else by the predicted one."""
    if profile.peak_C_bytes is not None:
        return profile.peak_C_bytes <= budget
    return profile.m_o_bytes + sum(b.m_bytes for b in profile.blocks) <= budget


def _report(profile: Profile, plan: Plan, measured: dict[str, tuple[float, int]], out: TextIO) -> None:
    """Per-block table, then predicted and measured totals of the plan and both baselines.

    Predictions come from the profile's model (baseline-M: the profiled step; baseline-C:
    baseline-M minus every t_e, m_o plus every m_i); measurements are separate runs after it.
    """
    print(f"\n{'#':>3}  {'block':44s} {'mode':4s} {'t_e ms':>8s} {'m_i':>11s} {'m_i (tracker)':>14s}", file=out)
    for i, b in enumerate(profile.blocks):
        tracker = format_bytes(b.m_tracker_bytes) if b.m_tracker_bytes is not None else "-"
        print(f"{i:>3}  {b.name[-44:]:44s} {plan.modes[b.name]:4s} {b.t_e_s * 1e3:8.2f} "
              f"{format_bytes(b.m_bytes):>11s} {tracker:>14s}", file=out)
    sum_te = sum(b.t_e_s for b in profile.blocks)
    sum_m = sum(b.m_bytes for b in profile.blocks)
    print(f"     {'total (' + str(len(plan.c_mode_blocks)) + ' in C-mode)':44s} {'':4s} {sum_te * 1e3:8.2f} "
          f"{format_bytes(sum_m):>11s}", file=out)
    print(f"\nm_o (baseline-M peak) {format_bytes(profile.m_o_bytes)}, of which fixed (parameters, buffers, "
          f"gradients, {profile.optimizer or 'optimizer'} state) {format_bytes(profile.fixed_bytes or 0)}", file=out)
    budget = plan.budget_bytes
    predicted = {
        "plan": (plan.predicted_step_time_s, plan.predicted_peak_bytes),
        "baseline-M": (profile.step_time_M_s, profile.m_o_bytes),
        "baseline-C": (profile.step_time_M_s - sum_te, profile.m_o_bytes + sum_m),
    }
    print(f"\n{'':12s} {'pred step s':>12s} {'meas step s':>12s} {'pred peak':>11s} {'meas peak':>11s}  "
          f"budget {format_bytes(budget)}", file=out)
    for name, (pt, pp) in predicted.items():
        if name not in measured:
            seen = profile.peak_C_bytes
            peak = f"measured peak {format_bytes(seen)}" if seen is not None else f"predicted peak {format_bytes(pp)}"
            print(f"{name:12s} does not fit the budget ({peak}); not run", file=out)
            continue
        mt, mp = measured[name]
        fits = "within budget" if mp <= budget else "OVER BUDGET"
        print(f"{name:12s} {pt:12.4f} {mt:12.4f} {format_bytes(pp):>11s} {format_bytes(mp):>11s}  {fits}", file=out)
    if profile.step_time_C_s is not None:
        print(f"\ncheck: sum of t_e {sum_te:.4f} s; profiled baseline-M - baseline-C "
              f"{profile.step_time_M_s - profile.step_time_C_s:.4f} s", file=out)
    if profile.peak_C_bytes is not None:
        print(f"check: m_o + sum(m_i) {format_bytes(profile.m_o_bytes + sum_m)} bounds the profiled "
              f"baseline-C peak {format_bytes(profile.peak_C_bytes)}", file=out)
    rss = process_peak_rss_bytes()
    if rss is not None and profile.device == "cpu":
        print(f"process peak RSS so far {format_bytes(rss)} (coarse: interpreter and every run included)", file=out)
    print(f"\n{plan.summary()}", file=out)


def _report_sweep(result: SweepResult, out: TextIO) -> None:
    print(f"\n{'batch':>6s} {'modes (M/C per block)':30s} {'pred s/step':>11s} {'pred ms/sample':>14s} "
          f"{'pred peak':>11s} {'meas s/step':>11s} {'meas peak':>11s}", file=out)
    for p in result.points:
        if not p.feasible:
            print(f"{p.batch_size:>6d} {'no plan fits the budget':30s}", file=out)
            continue
        modes = "".join(p.modes.values())
        modes = modes if len(modes) <= 30 else modes[:27] + "..."
        print(f"{p.batch_size:>6d} {modes:30s} {p.predicted_step_time_s:11.4f} "
              f"{p.predicted_time_per_sample_s * 1e3:14.3f} {format_bytes(p.predicted_peak_bytes):>11s} "
              f"{_opt(p.measured_step_time_s, '11.4f')} "
              f"{format_bytes(p.measured_peak_bytes) if p.measured_peak_bytes is not None else '-':>11s}", file=out)
    if result.best_batch_size is not None:
        print(f"best batch size: {result.best_batch_size} ({result.best_basis} time per sample)", file=out)
    else:
        print("no batch size of the sweep fits the budget", file=out)


def _opt(x: float | None, fmt: str) -> str:
    width = int(fmt.split(".")[0])
    return format(x, fmt) if x is not None else "-".rjust(width)


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--input-shape must be integers like 3,32,32, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise ValueError(f"--input-shape must be positive integers like 3,32,32, got {text!r}")
    return shape


def _synthetic_batch(
    batch_size: int, shape: tuple[int, ...], num_classes: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, *shape, generator=gen).to(device, dtype)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)
    return x, y
