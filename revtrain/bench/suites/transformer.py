"""Memory and step time of the reversible Transformer LM against its plain twin and checkpointing.

Two sweeps on one byte-level language model shape (``TransformerConfig``; dropout 0, so the
attention runs PyTorch's fused CPU kernel):

1. **Depth** (default 2 → 24 layers at 512 tokens): memory only. Shows that M-mode keeps one
   output per run of blocks, whatever the depth, while the plain twin keeps every layer's
   activations.
2. **Sequence length** (default 256 → 2048 tokens at 4 layers): memory and step time, methods
   interleaved round-robin in the same run:

   - ``plain``: :class:`~revtrain.models.TransformerLM`, ordinary residuals (the reference);
   - ``checkpoint``: the same plain model with ``torch.utils.checkpoint`` around each layer;
   - ``C`` / ``M``: :class:`~revtrain.models.RevTransformerLM` with every block in C / M mode;
   - ``M-chunked``: M-mode with the feed-forward applied in ``--chunks`` slices of the sequence;
   - ``reformer``: reformer-pytorch's ``ReversibleSequence`` driving the very same attention and
     feed-forward modules (an outside anchor; skipped with a note when not installed:
     ``pip install --no-deps reformer-pytorch einops``).

Both twins are built from the same seed, so they start from the same weights (the reversible
model computes a different function, so its loss differs). Before timing, gradients are checked:
M, M-chunked and reformer against C (same function), checkpoint against plain.

Memory (``revtrain.memory.track_peak_memory``: a tensor tracker on CPU, the allocator on CUDA),
one step per method with gradients starting as None, as after ``zero_grad()``:
``kept`` = tensor bytes still alive after forward and loss (what is kept for backward: the
activations), ``peak`` = the step's peak, parameter gradients included.

    revtrain bench transformer --threads 1
    revtrain bench transformer --shapes 256 512 --repeats 5    # sequence lengths of the second sweep
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from revtrain import set_modes
from revtrain.bench.report import Column, Report, Table
from revtrain.device import synchronize
from revtrain.memory import format_bytes, track_peak_memory
from revtrain.models import RevTransformerLM, TransformerConfig, TransformerLM

METHODS = ("plain", "checkpoint", "C", "M", "M-chunked", "reformer")
REFERENCE = {"checkpoint": "plain", "M": "C", "M-chunked": "C", "reformer": "C"}


class _Moded(nn.Module):
    """Run a reversible model with every block in one mode (set before each forward)."""

    def __init__(self, model: nn.Module, mode: str) -> None:
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, ids: Tensor) -> Tensor:
        set_modes(self.model, self.mode)
        return self.model(ids)


class _Checkpointed(nn.Module):
    """The plain twin with ``torch.utils.checkpoint`` around every layer."""

    def __init__(self, plain: TransformerLM) -> None:
        super().__init__()
        self.plain = plain

    def forward(self, ids: Tensor) -> Tensor:
        h = self.plain.embed(ids)
        for layer in self.plain.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return self.plain.head(h)


class _ReformerAnchor(nn.Module):
    """reformer-pytorch's reversible sequence over our F (attention) and G (feed-forward)."""

    def __init__(self, rev: RevTransformerLM, sequence_cls: type[nn.Module]) -> None:
        super().__init__()
        self.rev = rev
        self.sequence = sequence_cls([(block.f, block.g) for block in rev.layers])

    def forward(self, ids: Tensor) -> Tensor:
        h = self.rev.embed(ids)
        y1, y2 = self.sequence(torch.cat([h, h], dim=-1)).chunk(2, dim=-1)
        return self.rev.head(0.5 * (y1 + y2))


def _reformer_sequence() -> tuple[type[nn.Module] | None, str]:
    try:
        from reformer_pytorch.reversible import ReversibleSequence
        import reformer_pytorch
    except Exception as err:  # any import failure: the anchor is optional
        return None, f"reformer-pytorch not available ({type(err).__name__}: {err}); anchor skipped"
    version = getattr(reformer_pytorch, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("reformer-pytorch")
    return ReversibleSequence, f"reformer-pytorch {version}"


def build_methods(config: TransformerConfig, methods: list[str], chunks: int, device: torch.device,
                  seed: int = 0) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """Each method's model, and the module whose ``named_parameters`` name its gradients."""
    torch.manual_seed(seed)
    rev = RevTransformerLM(config).to(device)
    torch.manual_seed(seed)
    plain = TransformerLM(config).to(device)
    models: dict[str, nn.Module] = {}
    owners: dict[str, nn.Module] = {}
    for method in methods:
        if method == "plain":
            models[method], owners[method] = plain, plain
        elif method == "checkpoint":
            models[method], owners[method] = _Checkpointed(plain), plain
        elif method in ("C", "M"):
            models[method], owners[method] = _Moded(rev, method), rev
        elif method == "M-chunked":
            chunked = RevTransformerLM(replace(config, ff_chunks=chunks)).to(device)
            chunked.load_state_dict(rev.state_dict())
            models[method], owners[method] = _Moded(chunked, "M"), chunked
        elif method == "reformer":
            sequence_cls, _ = _reformer_sequence()
            if sequence_cls is not None:
                models[method], owners[method] = _ReformerAnchor(rev, sequence_cls), rev
    for model in models.values():
        model.train()
    return models, owners


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _clear(models: dict[str, nn.Module]) -> None:
    for model in models.values():
        for p in model.parameters():
            p.grad = None


def check_gradients(models, owners, x, y) -> dict[str, float]:
    """Relative L2 distance of each method's gradients from its reference's; raise when off."""
    grads = {}
    for method, model in models.items():
        _clear(models)
        _loss(model, x, y).backward()
        grads[method] = [p.grad.detach().double().clone() for _, p in owners[method].named_parameters()]
    _clear(models)
    errors = {}
    for method, ref in REFERENCE.items():
        if method in grads and ref in grads:
            diff = sum(float((a - b).square().sum()) for a, b in zip(grads[method], grads[ref], strict=True))
            norm = sum(float(b.square().sum()) for b in grads[ref])
            errors[method] = (diff / norm) ** 0.5
            if not errors[method] < 1e-3:
                raise RuntimeError(f"{method} gradients differ from {ref}'s by {errors[method]:.2e}; not timing a broken path")
    return errors


def measure_memory(models, x, y, device) -> dict[str, tuple[int, int]]:
    """(kept after forward, step peak) per method."""
    out = {}
    for method, model in models.items():
        _clear(models)
        gc.collect()
        with track_peak_memory(device) as mem:
            loss = _loss(model, x, y)
            kept = mem.end_bytes
            loss.backward()
            del loss
        out[method] = (kept, mem.peak_bytes)
    _clear(models)
    return out


def time_steps(models, x, y, device, repeats: int, warmup: int) -> dict[str, tuple[list[float], list[float]]]:
    """Wall and CPU seconds per step, methods interleaved round-robin with a rotating start."""
    names = list(models)
    times = {m: ([], []) for m in names}
    for r in range(warmup + repeats):
        for k in range(len(names)):
            method = names[(r + k) % len(names)]
            _clear(models)
            synchronize(device)
            cpu, wall = time.process_time(), time.perf_counter()
            _loss(models[method], x, y).backward()
            synchronize(device)
            if r >= warmup:
                times[method][0].append(time.perf_counter() - wall)
                times[method][1].append(time.process_time() - cpu)
    _clear(models)
    return times


def _batch(config: TransformerConfig, batch: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, length + 1), generator=gen).to(device)
    return ids[:, :-1], ids[:, 1:]


def depth_sweep(args, device, log) -> list[dict]:
    rows = []
    for depth in args.depths:
        config = TransformerConfig(width=args.width, heads=args.heads, depth=depth, context=args.depth_seq_len)
        models, owners = build_methods(config, ["plain", "checkpoint", "C", "M"], args.chunks, device)
        x, y = _batch(config, args.batch, args.depth_seq_len, device)
        errors = check_gradients(models, owners, x, y)
        memory = measure_memory(models, x, y, device)
        params = sum(p.numel() * p.element_size() for p in owners["plain"].parameters())
        for method, (kept, peak) in memory.items():
            rows.append(dict(depth=depth, method=method, kept_bytes=kept, peak_bytes=peak, param_bytes=params,
                             grad_rel_err=errors.get(method)))
        log(f"depth {depth}: " + ", ".join(f"{m} peak {format_bytes(p)}" for m, (_, p) in memory.items()))
    return rows


def seq_sweep(args, device, log) -> list[dict]:
    rows = []
    for length in args.seq_lens:
        config = TransformerConfig(width=args.width, heads=args.heads, depth=args.seq_depth, context=length)
        models, owners = build_methods(config, args.methods, args.chunks, device)
        x, y = _batch(config, args.seq_batch, length, device)
        errors = check_gradients(models, owners, x, y)
        times = time_steps(models, x, y, device, args.repeats, args.warmup)
        memory = measure_memory(models, x, y, device)
        plain_wall = statistics.median(times["plain"][0])
        plain_cpu = statistics.median(times["plain"][1])
        for method in models:
            wall, cpu = times[method]
            kept, peak = memory[method]
            rows.append(dict(
                seq_len=length, method=method, time_median_s=statistics.median(wall), time_min_s=min(wall),
                time_ratio=statistics.median(wall) / plain_wall, cpu_time_ratio=statistics.median(cpu) / plain_cpu,
                kept_bytes=kept, peak_bytes=peak, peak_ratio=peak / memory["plain"][1],
                grad_rel_err=errors.get(method), times_s=wall,
            ))
        log(f"T={length}: " + ", ".join(
            f"{r['method']} {r['time_median_s'] * 1e3:.0f} ms ({r['time_ratio']:.2f}x) peak {format_bytes(r['peak_bytes'])}"
            for r in rows if r["seq_len"] == length))
    return rows


def run(options, device: torch.device, out: Path, log) -> Report:
    quick = options.quick
    args = SimpleNamespace(
        width=16 if quick else 128, heads=2 if quick else 4, chunks=2 if quick else 8,
        depths=(2,) if quick else (2, 4, 8, 16, 24), depth_seq_len=16 if quick else 512, batch=2 if quick else 4,
        seq_lens=tuple(int(s) for s in options.shapes) or ((16, 32) if quick else (256, 512, 1024, 2048)),
        seq_depth=2 if quick else 4, seq_batch=2, repeats=options.pick(3, 2),
        warmup=options.warmup_steps(),
        methods=list(METHODS),
    )
    anchor_cls, anchor_note = _reformer_sequence()
    depth_rows = depth_sweep(args, device, log)
    seq_rows = seq_sweep(args, device, log)
    plain = {r["depth"]: r["peak_bytes"] for r in depth_rows if r["method"] == "plain"}
    for r in depth_rows:
        r["peak_x_plain"] = r["peak_bytes"] / plain[r["depth"]]
    for r in seq_rows:
        r.pop("times_s")
    depth = Table(
        "depth", "Depth sweep (memory)",
        [Column("depth", "layers", "int"), Column("method", "method"), Column("kept_bytes", "kept after forward", "bytes"),
         Column("peak_bytes", "step peak", "bytes"), Column("peak_x_plain", "peak × plain", "ratio"),
         Column("param_bytes", "parameters", "bytes"), Column("grad_rel_err", "grad rel. err", "sci")],
        depth_rows, note=f"Batch {args.batch} × {args.depth_seq_len} tokens.")
    seq = Table(
        "seq_len", "Sequence-length sweep (memory and time)",
        [Column("seq_len", "tokens", "int"), Column("method", "method"), Column("time_median_s", "median step", "ms"),
         Column("time_ratio", "time × plain", "ratio"), Column("cpu_time_ratio", "CPU time × plain", "ratio"),
         Column("kept_bytes", "kept after forward", "bytes"), Column("peak_bytes", "step peak", "bytes"),
         Column("peak_ratio", "peak × plain", "ratio"), Column("grad_rel_err", "grad rel. err", "sci")],
        seq_rows,
        note=(f"{args.seq_depth} layers, batch {args.seq_batch}; median of {args.repeats} timed steps after "
              f"{args.warmup} warm-up round(s), methods interleaved round-robin; M-chunked = feed-forward in "
              f"{args.chunks} slices."))
    intro = (f"Byte-level LM (`TransformerConfig`: width {args.width} per stream, {args.heads} heads, feed-forward 4x, "
             "vocabulary 256, learned positions, dropout 0, float32). Step = forward + cross-entropy + backward. "
             "'kept after forward' = tensor bytes alive after forward and loss (what backward will use); 'step peak' = "
             "the highest tensor bytes during the step, parameter gradients included. 'grad rel. err' = relative L2 "
             "distance of all parameter gradients from the reference (M, M-chunked, reformer: C; checkpoint: plain).")
    return Report("transformer", "Reversible Transformer: memory and step time against its plain twin", {},
                  [depth, seq], intro=intro, notes=[f"outside anchor: {anchor_note}"])
