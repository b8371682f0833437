"""Step time and peak memory of a RevNet-style stack under four ways of training it.

The stack is ``depth`` additive coupling blocks ``y1 = x1 + F(x2); y2 = x2 + G(y1)`` where ``F``
and ``G`` are each Conv3x3 (no bias) + BatchNorm + ReLU on half the channels. One set of weights
is trained four ways in the same process, on the same batch:

- ``"plain"``: an ordinary ``nn.Sequential`` of plain coupling modules that pass the pair of
  halves along; no revtrain code runs. Every ratio is taken against it.
- ``"M"``: :class:`~revtrain.core.ReversibleSequence`, every block in M-mode (rebuild in backward),
  with the blocks' default options (RNG capture and the reconstruction check on), as a user gets.
- ``"C"``: the same sequence, every block in C-mode (revtrain's plain-autograd path).
- ``"checkpoint"``: the plain model with ``torch.utils.checkpoint.checkpoint(block, pair,
  use_reentrant=False)`` around each block.

For each depth the methods are first checked against ``"plain"`` (every parameter gradient and
the input gradient, float32 sanity level), so a broken path cannot be timed silently. Timing then
interleaves the methods round-robin, rotating which goes first, so that load from other processes
hits all of them alike, and each timed step follows an untimed step of the same method (the
steady state of training with it: a step is faster or slower by what the step before it left
in the allocator); memory is measured in a separate pass because the CPU tracker slows ops.

Example:
    >>> rows = run_stack_benchmark(StackBenchConfig(depths=(4, 8), repeats=3))
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from revtrain.bench.peers import PEERS, build_peer, peer_status
from revtrain import ReversibleBlock, ReversibleSequence, set_modes, set_rebuild_checks
from revtrain.device import float_dtype, resolve_device, synchronize
from revtrain.memory import track_peak_memory
from revtrain.timing import iqr

__all__ = [
    "METHODS",
    "EXTRA_METHODS",
    "StackBenchConfig",
    "StackBenchRow",
    "GradientMismatchError",
    "run_stack_benchmark",
    "stack_setup",
    "parse_stack_shape",
    "resolve_device",
]

OURS: tuple[str, ...] = ("plain", "M", "C", "checkpoint")
"""revtrain's methods and plain PyTorch's, in table order; ``"plain"`` is the reference."""

METHODS: tuple[str, ...] = OURS + PEERS
"""Every method the stack benchmark knows: ours, then the peer libraries (when installed)."""

EXTRA_METHODS: tuple[str, ...] = ("M-nocheck", "M-check1", "M-check4", "M-norng", "M-exact", "M-chain", "M-overlap")
"""Variants of M-mode measured on request: without the rebuild check, with the check on every
step (``check_every=1``) or on one step in four (``check_every=4``), without capturing the
random generators (``preserve_rng_state=False``: what an author whose ``F`` and ``G`` draw no
random numbers passes, as the zoo's RevNets do; the peers replay no random numbers at all),
with exact (fixed-point) couplings, as standalone blocks chained on
pairs instead of one ``ReversibleSequence``, and with the rebuild of each block overlapped with
the gradients of the block above (``overlap_rebuild=True``: a second CUDA stream; on the CPU
the same schedule on one stream)."""


class GradientMismatchError(RuntimeError):
    """A method's gradients differ from plain autograd's: its timing would measure a broken path."""


@dataclass(kw_only=True)
class StackBenchConfig:
    """What to build and how often to measure it."""

    batch: int = 32
    """Mini-batch size."""
    channels: int = 64
    """Channels of the stack's input; F and G each work on half of them. Must be even."""
    size: int = 32
    """Height and width of the feature maps."""
    depths: tuple[int, ...] = (4, 8, 16, 32)
    """Numbers of coupling blocks; one stack is built and measured per depth."""
    methods: tuple[str, ...] = OURS
    """Which of ``METHODS`` to run; ``"plain"`` must be among them (ratios are taken against it).
    Peer libraries (``"revlib"``, ``"memcnn"``, ``"reformer"``, ``"revtorch"``) must be installed."""
    repeats: int = 5
    """Timed steps per method and depth; the table reports their median, IQR and minimum."""
    warmup: int = 1
    """Untimed steps per method and depth before timing (allocator, oneDNN/cuDNN kernel choice);
    the gradient check, when on, runs every method once more before these."""
    device: str = "auto"
    """``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"auto"`` (CUDA when available)."""
    dtype: str = "float32"
    """Parameter and activation dtype: ``"float32"``, ``"float64"``, ``"bfloat16"``, ``"float16"``."""
    threads: int | None = None
    """CPU threads for intra-op parallelism during the run (``torch.set_num_threads``), restored
    afterwards; ``None`` keeps the process's setting."""
    seed: int = 0
    """Seeds the weights and the batch."""
    measure_memory: bool = True
    """Measure the peak memory of one step per method (a separate, untimed pass)."""
    check_gradients: bool = True
    """Compare each method's gradients with plain autograd's once per depth before timing."""
    grad_tolerance: float = 1e-2
    """Largest allowed ``||g - g_plain|| / ||g_plain||`` over all gradients concatenated. A sanity
    bound that a broken path (a missing or doubled term) exceeds by far, well above float32's
    rebuild drift (the measured errors are in the core suite's results)."""

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):  # accept torch.float32 as well as "float32"
            self.dtype = str(float_dtype(self.dtype)).removeprefix("torch.")
        for name in ("batch", "channels", "size", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StackBenchConfig.{name} must be a positive integer, got {value!r}")
        if self.channels % 2:
            raise ValueError(
                f"channels must be even (F and G each take half), got {self.channels}; use "
                f"{self.channels + 1}"
            )
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative integer, got {self.warmup!r}")
        self.depths = tuple(self.depths)
        if not self.depths or any(not isinstance(d, int) or d < 1 for d in self.depths):
            raise ValueError(f"depths must be positive integers, got {self.depths!r}")
        self.methods = tuple(self.methods)
        unknown = [m for m in self.methods if m not in METHODS + EXTRA_METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS + EXTRA_METHODS)}")
        if "plain" not in self.methods:
            raise ValueError(
                "methods must include 'plain': every ratio in the table is taken against it"
            )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must not repeat, got {self.methods!r}")
        missing = [problem for m in self.methods if m in PEERS and (problem := peer_status(m))]
        if missing:
            raise ValueError("; ".join(missing))
        float_dtype(self.dtype)
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer or None, got {self.threads!r}")
        if not self.grad_tolerance > 0:
            raise ValueError(f"grad_tolerance must be positive, got {self.grad_tolerance!r}")
        resolve_device(self.device)  # fail here, not after building models

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a :class:`torch.dtype`."""
        return float_dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for results files."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class StackBenchRow:
    """The measurements of one method at one depth."""

    depth: int
    """Number of coupling blocks."""
    method: str
    """One of :data:`METHODS`."""
    time_median_s: float
    """Median seconds of one step (forward + loss + backward) over the timed repeats."""
    time_iqr_s: float
    """Interquartile range of the step times (0 with fewer than 2 repeats)."""
    time_min_s: float
    """Fastest step."""
    time_ratio: float
    """``time_median_s`` divided by plain autograd's at the same depth, in the same run."""
    time_ratio_paired: float
    """Median over repeats of (this step / plain's step in the same round): robust to load that
    changes between rounds."""
    cpu_time_median_s: float | None
    """Median process CPU seconds (all threads) of one step; None on CUDA, where the host's time
    says little. Less disturbed than wall time when other processes share the cores (a thread
    waiting for the CPU does not accumulate it), so its ratio is the cross-check on a busy machine."""
    cpu_time_ratio: float | None
    """``cpu_time_median_s`` divided by plain autograd's at the same depth."""
    peak_bytes: int | None
    """Peak tensor bytes allocated during one step, above what was live before (None: not measured)."""
    peak_ratio: float | None
    """``peak_bytes`` divided by plain autograd's at the same depth."""
    grad_rel_err: float | None
    """``||g - g_plain|| / ||g_plain||`` over every parameter gradient and the input gradient,
    concatenated (None: not checked, or the plain row itself)."""
    times_s: tuple[float, ...] = field(default=())
    """Every timed step, in the order taken."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for results files."""
        return asdict(self)


# ----------------------------------------------------------------------------- models


def _residual_fn(channels: int) -> nn.Sequential:
    """Conv3x3 + BatchNorm + ReLU on one half; bias-free conv as in RevNet."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
    )


Pair = tuple[Tensor, Tensor]


class _PlainCoupling(nn.Module):
    """``y1 = x1 + F(x2); y2 = x2 + G(y1)`` written out directly: the plain-autograd reference.

    It maps a pair of halves to a pair, so the stack splits once and concatenates once, as
    revtrain's sequence does; a ``cat`` + ``chunk`` per block would cost plain autograd time
    that the reversible paths do not pay, and flatter their ratios.
    """

    def __init__(self, f: nn.Module, g: nn.Module) -> None:
        super().__init__()
        self.f = f
        self.g = g

    def forward(self, pair: Pair) -> Pair:
        x1, x2 = pair  # (B, C/2, H, W) each
        y1 = x1 + self.f(x2)
        y2 = x2 + self.g(y1)
        return y1, y2


class _PlainStack(nn.Module):
    """Split into halves, run the coupling modules in order, concatenate."""

    def __init__(self, blocks: nn.Sequential, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = blocks
        self.checkpointed = checkpointed

    def forward(self, x: Tensor) -> Tensor:
        pair: Pair = tuple(x.chunk(2, dim=1))  # type: ignore[assignment]
        if self.checkpointed:
            for block in self.blocks:
                pair = checkpoint(block, pair, use_reentrant=False)
        else:
            pair = self.blocks(pair)
        return torch.cat(pair, dim=1)


def _build_models(depth: int, config: StackBenchConfig, device: torch.device) -> dict[str, nn.Module]:
    """One set of F/G modules shared by every method: the same weights by construction."""
    half = config.channels // 2
    fgs = [(_residual_fn(half), _residual_fn(half)) for _ in range(depth)]
    couplings = nn.Sequential(*(_PlainCoupling(f, g) for f, g in fgs))
    models: dict[str, nn.Module] = {"plain": _PlainStack(couplings)}
    for mode in ("M", "C"):
        if mode in config.methods:
            seq = ReversibleSequence([ReversibleBlock(f, g) for f, g in fgs])
            set_modes(seq, mode)
            models[mode] = seq
    if "checkpoint" in config.methods:
        models["checkpoint"] = _PlainStack(couplings, checkpointed=True)
    for peer in PEERS:
        if peer in config.methods:
            models[peer] = build_peer(peer, fgs)
    for name, every in (("M-nocheck", 0), ("M-check1", 1), ("M-check4", 4)):
        if name in config.methods:
            models[name] = ReversibleSequence([ReversibleBlock(f, g) for f, g in fgs])
            set_rebuild_checks(models[name], every)
    if "M-norng" in config.methods:
        models["M-norng"] = ReversibleSequence([ReversibleBlock(f, g, preserve_rng_state=False) for f, g in fgs])
    if "M-exact" in config.methods:
        models["M-exact"] = ReversibleSequence([ReversibleBlock(f, g, coupling="exact") for f, g in fgs])
    if "M-overlap" in config.methods:  # PaReprop-style: rebuilds on a second CUDA stream
        models["M-overlap"] = ReversibleSequence([ReversibleBlock(f, g) for f, g in fgs], overlap_rebuild=True)
    if "M-chain" in config.methods:
        models["M-chain"] = _PlainStack(nn.Sequential(*(ReversibleBlock(f, g) for f, g in fgs)))
    for model in models.values():
        model.to(device=device, dtype=config.torch_dtype).train()
    return {m: models[m] for m in config.methods}


# ----------------------------------------------------------------------------- one step


def _clear_grads(params: Sequence[Tensor], x: Tensor) -> None:
    for p in params:
        p.grad = None
    x.grad = None


def _step(model: nn.Module, x: Tensor) -> None:
    """Forward + loss + backward, as one training step would run them."""
    out = model(x)
    loss = out.float().square().mean()
    loss.backward()


def _timed_step(
    model: nn.Module, x: Tensor, params: Sequence[Tensor], device: torch.device
) -> tuple[float, float]:
    """Wall seconds and process CPU seconds of one step."""
    _clear_grads(params, x)
    synchronize(device)
    cpu_start, start = time.process_time(), time.perf_counter()
    _step(model, x)
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu_start


def _gradients(model: nn.Module, x: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    _clear_grads(params, x)
    _step(model, x)
    grads = [p.grad for p in params] + [x.grad]
    missing = sum(g is None for g in grads)
    if missing:
        raise GradientMismatchError(f"{missing} of {len(grads)} gradients were not computed")
    return [g.detach().clone() for g in grads]  # type: ignore[union-attr]


def _rel_err(got: list[Tensor], want: list[Tensor]) -> float:
    """Relative L2 distance of all gradients concatenated (the RevNet paper's angle, in kind).

    The largest single-entry error is a poor sanity metric in float32: batch norm over a
    low-variance channel amplifies rounding in a few entries of one weight gradient, for plain
    float32 autograd against float64 as well.
    """
    diff = sum(float((g.double() - w.double()).square().sum()) for g, w in zip(got, want))
    norm = sum(float(w.double().square().sum()) for w in want)
    return (diff / norm) ** 0.5 if norm > 0 else diff**0.5


# ----------------------------------------------------------------------------- the run


def _check_gradients(
    depth: int, models: dict[str, nn.Module], x: Tensor, params: list[Tensor], tolerance: float
) -> dict[str, float | None]:
    """Each method's distance from plain autograd's gradients; raise when one is off."""
    errors: dict[str, float | None] = dict.fromkeys(models)
    reference = _gradients(models["plain"], x, params)
    for method, model in models.items():
        if method == "plain":
            continue
        err = _rel_err(_gradients(model, x, params), reference)
        if not err <= tolerance:
            raise GradientMismatchError(
                f"depth {depth}: gradients of method {method!r} differ from plain autograd's by "
                f"{err:.3g} (relative L2 distance over all gradients) > grad_tolerance="
                f"{tolerance:g}; the benchmark would time a broken path"
            )
        errors[method] = err
    return errors


def _time_round_robin(
    models: dict[str, nn.Module], x: Tensor, params: list[Tensor], config: StackBenchConfig,
    device: torch.device,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds per step, per method: warm-up rounds, then timed rounds."""
    methods = list(models)
    gc.collect()
    for _ in range(config.warmup):
        for method in methods:
            _timed_step(models[method], x, params, device)
    wall: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(config.repeats):
        # Round-robin, starting one method later each round, so no method always runs first;
        # each timed step right after an untimed one of its own, as in training with it.
        for k in range(len(methods)):
            method = methods[(r + k) % len(methods)]
            _timed_step(models[method], x, params, device)
            w, c = _timed_step(models[method], x, params, device)
            wall[method].append(w)
            cpu[method].append(c)
    return wall, cpu


def _peaks(
    models: dict[str, nn.Module], x: Tensor, params: list[Tensor], device: torch.device
) -> dict[str, int]:
    """Peak bytes of one step per method, parameter gradients included (they start as None)."""
    peaks = {}
    for method, model in models.items():
        _clear_grads(params, x)
        gc.collect()
        with track_peak_memory(device) as mem:
            _step(model, x)
        peaks[method] = mem.peak_bytes
    _clear_grads(params, x)
    return peaks


def stack_setup(
    depth: int, config: StackBenchConfig, device: torch.device
) -> tuple[dict[str, nn.Module], Tensor, list[Tensor]]:
    """What every measurement of the stack starts from, seeded by ``config.seed``: the model of
    each of ``config.methods`` (one set of F/G weights), the input batch and the parameters."""
    torch.manual_seed(config.seed)
    models = _build_models(depth, config, device)
    params = list(models["plain"].parameters())
    gen = torch.Generator().manual_seed(config.seed)
    x_cpu = torch.randn(config.batch, config.channels, config.size, config.size, generator=gen)
    # The input needs a gradient, as a stack inside a network (after a stem) does.
    x = x_cpu.to(device=device, dtype=config.torch_dtype).requires_grad_(True)
    return models, x, params


def parse_stack_shape(text: str) -> tuple[int, int, int, int]:
    """``"8x16x8x16"`` as ``(batch, channels, size, depth)``.

    Raises:
        ValueError: not four integers joined by ``x``; the message names the form.
    """
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 4:
        raise ValueError(f"a stack shape is BATCHxCHANNELSxSIZExDEPTH, e.g. 8x16x8x16; got {text!r}")
    return shape  # type: ignore[return-value]


def _measure_depth(
    depth: int, config: StackBenchConfig, device: torch.device, log: Callable[[str], None]
) -> list[StackBenchRow]:
    models, x, params = stack_setup(depth, config, device)

    errors: dict[str, float | None] = dict.fromkeys(models)
    if config.check_gradients:
        errors = _check_gradients(depth, models, x, params, config.grad_tolerance)
        log(f"depth {depth}: gradients match plain ({_format_errors(errors)})")
    wall, cpu = _time_round_robin(models, x, params, config, device)
    peaks: dict[str, int | None] = dict.fromkeys(models)
    if config.measure_memory:
        peaks.update(_peaks(models, x, params, device))

    plain_wall, plain_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
    plain_peak = peaks["plain"]
    rows = []
    for method in models:
        ts = wall[method]
        median = statistics.median(ts)
        cpu_median = statistics.median(cpu[method]) if device.type == "cpu" else None
        peak = peaks[method]
        rows.append(
            StackBenchRow(
                depth=depth,
                method=method,
                time_median_s=median,
                time_iqr_s=iqr(ts),
                time_min_s=min(ts),
                time_ratio=median / plain_wall,
                time_ratio_paired=statistics.median(t / p for t, p in zip(ts, wall["plain"])),
                cpu_time_median_s=cpu_median,
                cpu_time_ratio=cpu_median / plain_cpu if cpu_median is not None and plain_cpu else None,
                peak_bytes=peak,
                peak_ratio=peak / plain_peak if peak is not None and plain_peak else None,
                grad_rel_err=errors[method],
                times_s=tuple(ts),
            )
        )
    log(
        f"depth {depth}: "
        + ", ".join(f"{r.method} {r.time_median_s * 1e3:.0f} ms ({r.time_ratio:.2f}x)" for r in rows)
    )
    return rows


def _format_errors(errors: dict[str, float | None]) -> str:
    return ", ".join(f"{m} {e:.1e}" for m, e in errors.items() if e is not None) or "nothing to compare"


def run_stack_benchmark(
    config: StackBenchConfig, *, log: Callable[[str], None] | None = None
) -> list[StackBenchRow]:
    """Measure every method at every depth of ``config``; one row per (depth, method).

    Args:
        config: What to build and how often to measure.
        log: Called with one line of progress per stage (e.g. ``print``); silent when ``None``.

    Returns:
        Rows ordered by depth, then by ``config.methods``.

    Raises:
        GradientMismatchError: A method's gradients differ from plain autograd's (when
            ``config.check_gradients``), so its timing would be meaningless.
    """
    device = resolve_device(config.device)
    say = log if log is not None else (lambda _msg: None)
    threads_before = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        rows: list[StackBenchRow] = []
        for depth in config.depths:
            rows.extend(_measure_depth(depth, config, device, say))
    finally:
        torch.set_num_threads(threads_before)
    return rows
