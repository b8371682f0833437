"""Checks on every rebuild: does the rebuilt input match the one the forward saw?

The forward records a small *fingerprint* of each layer's input state and the scale of the
run's output; backward computes the same fingerprint of the rebuilt state and compares, with
one device sync for a whole run of layers.

A fingerprint of a tensor ``x`` is :data:`PROJECTIONS` random projections of it and an estimate
of its norm, from one pass over the data. ``x`` is seen (as a view, no copy) as ``A × R`` rows
of ``L`` contiguous values; one batched matrix product gives each row's projection onto two
fixed random vectors ``u_1, u_2`` (``W = X u``, two numbers per row), and fixed random vectors
across ``A`` (4) and across ``R`` (8) fold those into 2 × 4 × 8 numbers. Each projection is onto a
rank-one random tensor ``s_A ⊗ s_R ⊗ u``, whose projection of an error ``E`` has mean square
``‖E‖²``;
the root mean square of the differences over all projections estimates ``‖Δx‖`` in whatever
direction the error lies. (A norm alone misses errors orthogonal to ``x``: a 1% random error
moves the norm by 1e-4, a rotation not at all.) Two vectors ``u`` keep an error that is the same
in every row (a per-channel offset) from hiding in the one direction a single ``u`` cannot see.
The norm estimate is ``‖W‖ / √2`` (within a few percent for hundreds of rows); rows are made
no longer than leaves :data:`EXACT_NORM_ROWS` of them where the strides allow, and smaller
tensors pay one more pass for the exact norm. The random vectors are drawn once per shape from
a fixed seed (never from torch's global generators) and cached.

The pass over the data and the fold are separate (:class:`Fingerprints`): each state costs one
batched product per tensor when it is taken, and the fold runs once for all the states of a
run, in float32 or float64 whatever the autocast setting. On small tensors the check's cost is
the number of ops, not the data: this cut it from ~15 ops per state to 2.

The estimated error of one half is ``rms_j |Δp_j|``, divided by ``max(‖x_half‖, FLOOR · s)``,
where ``s`` is the larger of the norms of the layer's whole input and whole output state: a half
that is exactly zero (a zero stream, zero padding) is measured against the scale of the rest of
the block and never divides by zero.

A non-finite rebuild of a finite input raises :class:`ReconstructionError` naming the culprit:
the forward itself (``F`` or ``G`` already returned non-finite values) or the inverse. A relative
error above the layer's ``drift_tolerance`` warns, or raises with ``drift_action="raise"``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from revtrain.errors import ReconstructionDriftWarning, ReconstructionError

__all__ = [
    "fingerprint",
    "Fingerprints",
    "layout_of",
    "norms",
    "check_rebuilds",
    "check_run",
    "PROJECTIONS",
    "FLOOR",
    "RebuildCheck",
]

ROW_VECTORS = 2
"""Random vectors along the rows (both applied in one batched matrix product)."""

PROJECTIONS = 64
"""Random projections per tensor: 2 row vectors x 4 vectors across ``A`` x 8 across ``R``."""

EXACT_NORM_ROWS = 64
"""Below this many rows the norm estimate is too rough: compute the norm exactly."""

FLOOR = 0.1
"""A half's error is measured against at least this fraction of the block's input/output scale."""

_MAX_ROW = 4096
_SEED = 0x5EED
_FOLD_A, _FOLD_R = 4, 8  # random vectors across the two row dimensions: 2 x 4 x 8 = 64 projections
_vectors: dict[tuple[int, int, int, torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}

Layout = tuple[int, ...]
"""Per tensor of a state, where its rows start (see :func:`layout_of`)."""


def _row_start(x: Tensor) -> int:
    """The first dimension of a row: trailing dimensions that are contiguous in memory, up to
    :data:`_MAX_ROW` values (the last one always), leaving at least one dimension before and,
    where the tensor allows, :data:`EXACT_NORM_ROWS` rows (enough for the norm estimate)."""
    if x.dim() < 2 or (x.stride(-1) != 1 and x.shape[-1] != 1):
        return max(x.dim() - 1, 0)
    k, length, total = x.dim() - 1, x.shape[-1], x.numel()
    while k > 1 and x.stride(k - 1) == length and length * x.shape[k - 1] <= _MAX_ROW:
        longer = length * x.shape[k - 1]
        if total < longer * EXACT_NORM_ROWS and _merges(x, k - 1):
            break  # rows as long as they can be while enough remain
        length = longer
        k -= 1
    return k


def _merges(x: Tensor, n: int) -> bool:
    """Whether the first ``n`` dimensions of ``x`` can be viewed as one."""
    return all(x.stride(j) == x.stride(j + 1) * x.shape[j + 1] or x.shape[j] == 1 for j in range(n - 1))


def layout_of(state: Sequence[Tensor]) -> Layout:
    """How each tensor of ``state`` is cut into rows; a rebuild is fingerprinted with the
    forward's layout, so that a contiguous rebuild compares with a strided original."""
    return tuple(_row_start(x) for x in state)


def _slab_shape(x: Tensor, k: int) -> tuple[int, int, int]:
    """``(A, R, L)``: dims ``[0, k-1)``, dim ``k-1`` and dims ``[k, ...)`` of ``x`` merged."""
    if x.dim() < 2:
        return (1, 1, x.numel())
    return (math.prod(x.shape[: k - 1]), x.shape[k - 1], math.prod(x.shape[k:]))


def _as_slabs(x: Tensor, k: int) -> Tensor:
    """``x`` as ``(A, R, L)`` (:func:`_slab_shape`).

    A view where strides allow (a half split off a contiguous ``(B, C, H, W)`` tensor is the view
    ``(B, C/2, H·W)``; a half of ``(B, T, D)`` split on the last dimension ``(B, T, D/2)``), a
    copy otherwise (a strided tensor fingerprinted with another tensor's layout).
    """
    shape = _slab_shape(x, k)
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)


def _random_vectors(
    a: int, rows: int, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The row vectors ``u / sqrt(ROW_VECTORS)`` as ``(A, L, 2)`` for a batched product, the
    same two vectors as one complex vector where ``L`` is even (see :func:`_row_vectors`),
    ``s_A`` and ``sqrt(ROW_VECTORS) · s_R``: the scale moved from the fold onto ``u`` makes
    ``‖W‖`` the norm estimate itself (one op fewer per fingerprint), with the projections
    unchanged."""
    key = (a, rows, length, dtype, device)
    cached = _vectors.get(key)
    if cached is None:
        gen = torch.Generator().manual_seed(_SEED + 1_000_003 * length + 1009 * rows + a)
        u = _row_vectors(length, gen)
        s_a = _typical_sums(torch.randn(a, _FOLD_A, generator=gen, dtype=torch.float64))
        s_r = _typical_sums(torch.randn(rows, _FOLD_R, generator=gen, dtype=torch.float64))
        root = math.sqrt(ROW_VECTORS)
        complex_u = None
        if length % 2 == 0 and not dtype.is_complex:
            # v1 = (a, -b), v2 = (b, a) interleaved: x · (a + ib), summed, has v1·x and v2·x as
            # its real and imaginary parts.
            complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
            complex_u = torch.complex(u[0::2, 0], u[0::2, 1]).div(root).to(device=device, dtype=complex_dtype)
        u, s_a, s_r = (t.to(device=device, dtype=dtype) for t in (u / root, s_a, s_r * root))
        # A contiguous batch of u's multiplies faster than a broadcast view (small tensors are
        # bound by per-op cost); large batches keep the view instead of a large copy.
        batched = u.expand(a, length, ROW_VECTORS)
        cached = (batched.contiguous() if batched.numel() <= _MAX_PENDING else batched, complex_u, s_a, s_r)
        _vectors[key] = cached
    return cached


def _row_vectors(length: int, gen: torch.Generator) -> Tensor:
    """``(L, 2)`` float64: two random vectors along the rows whose sums are ``sqrt(L)``.

    For even ``L`` they come from ``L/2`` random complex numbers ``a_k + i b_k``: ``v1`` holds
    ``(a_k, -b_k)`` and ``v2`` holds ``(b_k, a_k)`` interleaved, so that one complex
    multiply-and-sum over a row (seen as ``L/2`` complex numbers) gives both projections in one
    pass (:func:`_row_projections`). ``Σa = sqrt(L)`` and ``Σb = 0`` make both sums ``sqrt(L)``:
    see :func:`_typical_sums` for why the sums are fixed.
    """
    if length % 2:
        return _typical_sums(torch.randn(length, ROW_VECTORS, generator=gen, dtype=torch.float64))
    half = length // 2
    ab = torch.randn(half, 2, generator=gen, dtype=torch.float64)
    ab = ab - ab.mean(dim=0, keepdim=True)
    a, b = ab[:, 0] + math.sqrt(length) / half, ab[:, 1]
    u = torch.empty(length, ROW_VECTORS, dtype=torch.float64)
    u[0::2, 0], u[1::2, 0] = a, -b
    u[0::2, 1], u[1::2, 1] = b, a
    return u


def _typical_sums(vectors: Tensor) -> Tensor:
    """Random column vectors whose sums are ``±sqrt(n)``, their typical size.

    An error that is the same all along one axis (a per-channel offset: the same in every
    position of a row, and in every sample) reaches a projection only through the sum of the
    random vector along that axis. Left to chance, a sum near zero would hide such errors for
    every tensor of that shape; fixed at its typical size, they are seen like any other.
    """
    n = vectors.shape[0]
    signs = torch.tensor([(-1.0) ** j for j in range(vectors.shape[1])], dtype=vectors.dtype)
    return vectors - vectors.mean(dim=0, keepdim=True) + signs / math.sqrt(n)


class _Plan(NamedTuple):
    """How to fingerprint a tensor of one shape, dtype, device and row layout."""

    shape: tuple[int, int, int]
    """The ``(A, R, L)`` slab view."""
    upcast: bool
    """Half precision: the products run in float32 (they would round coarsely)."""
    u: Tensor | None
    """The row vectors, ``(A, L, 2)`` (None for an empty tensor)."""
    complex_u: Tensor | None
    """The same as one complex vector, on CPUs (None where ``L`` is odd, or on other devices)."""
    fold: tuple[Tensor, ...] | None
    """How :func:`_fold_rows` folds ``W``: ``(s_A ⊗ s_R,)`` as one ``(A·R, 32)`` matrix, or
    ``(s_A, s_R)`` where that matrix would be large."""
    exact_norm: bool
    """Too few rows for the norm estimate."""
    values: int
    """Values of ``W`` it produces."""

    @classmethod
    def of(cls, x: Tensor, k: int) -> _Plan:
        a, r, length = _slab_shape(x, k)
        upcast = x.dtype in (torch.float16, torch.bfloat16)
        if not x.numel():
            return cls((a, r, length), upcast, None, None, None, False, 0)
        u, complex_u, s_a, s_r = _random_vectors(a, r, length, torch.float32 if upcast else x.dtype, x.device)
        if x.device.type != "cpu" or x.numel() < _COMPLEX_MIN:
            # cuBLAS does the batched product at memory speed; on small tensors one op is
            # cheaper than the complex path's few.
            complex_u = None
        if a * r <= _MAX_KRON_ROWS:  # one product folds W (4 ops fewer, for small tensors)
            fold: tuple[Tensor, ...] = (torch.einsum("ap,rq->arpq", s_a, s_r).reshape(a * r, _FOLD_A * _FOLD_R),)
        else:
            fold = (s_a, s_r)
        return cls((a, r, length), upcast, u, complex_u, fold, a * r < EXACT_NORM_ROWS, a * r * ROW_VECTORS)


_plans: dict[tuple[int, torch.Size, torch.dtype, torch.device], _Plan] = {}


def _slab(x: Tensor, plan: _Plan) -> Tensor:
    """``x`` as its plan's ``(A, R, L)`` slab: a view where strides allow, else a copy."""
    if x.requires_grad:
        x = x.detach()
    try:
        slab = x.view(plan.shape)
    except RuntimeError:  # a strided tensor fingerprinted with another tensor's layout
        slab = x.reshape(plan.shape)
    return slab.float() if plan.upcast else slab


def _row_projections(slab: Tensor, plan: _Plan) -> Tensor:
    """``W = X u``: ``(A, R, 2)``, each row's projections onto the two row vectors.

    On CPUs, one complex multiply-and-sum (the row seen as ``L/2`` complex numbers) in chunks
    of at most :data:`_CHUNK` values: a batched matrix product with two columns runs at a
    fraction of memory speed there (MKL: 600 µs for a (32, 32, 1024) float32 slab, 180 µs this
    way), and the chunks bound the temporary of the product.
    """
    if plan.complex_u is not None:
        a, r, length = plan.shape
        try:
            xc = torch.view_as_complex(slab.view(a, r, length // 2, 2))
        except RuntimeError:  # an odd stride or offset (a strided half): the batched product
            return torch.bmm(slab, plan.u)  # type: ignore[arg-type]
        out = torch.empty((a, r), dtype=plan.complex_u.dtype)
        rows = max(1, _CHUNK // (length // 2))
        if a * r <= rows:
            torch.sum(xc * plan.complex_u, dim=-1, out=out)
        elif r <= rows:
            step = rows // r
            for i in range(0, a, step):
                torch.sum(xc[i : i + step] * plan.complex_u, dim=-1, out=out[i : i + step])
        else:
            for i in range(a):
                for j in range(0, r, rows):
                    torch.sum(xc[i, j : j + rows] * plan.complex_u, dim=-1, out=out[i, j : j + rows])
        return torch.view_as_real(out)
    return torch.bmm(slab, plan.u)  # type: ignore[arg-type]


_COMPLEX_MIN = 1 << 15
"""Values from which a CPU tensor takes the complex path of :func:`_row_projections`."""

_CHUNK = 1 << 17
"""Complex values multiplied at a time by :func:`_row_projections` (a 1 MiB temporary)."""

_MAX_PENDING = 1 << 16
"""Row projections (values) kept before :class:`Fingerprints` folds them: 256 KiB in float32."""


class Fingerprints:
    """Fingerprints of many states, each read once when added and folded together later.

    :meth:`add` does the one pass over a state's data (a batched matrix product per tensor,
    giving its row projections ``W``); the few small ops that fold ``W`` into norms and
    projections run once for many states (on small tensors the number of ops, not the data, is
    the check's cost). At most :data:`_MAX_PENDING` values of ``W`` wait to be folded.
    """

    def __init__(self) -> None:
        self._done: list[Tensor] = []  # per state folded (see _unsplit)
        self._folded = 0  # states folded
        self._batch: Tensor | None = None  # every state folded at once: (states, n, 1 + P)
        self._unsplit: tuple[Tensor, list[int]] | None = None  # the batch not yet in _done
        # Per state: its length, and per tensor W (None when empty) with its plan's fold, and
        # the exact norm (small tensors only).
        self._pending: list[tuple[int, list[tuple[Tensor, tuple[Tensor, ...]] | None], list[Tensor | None]]] = []
        self._pending_values = 0

    def add(self, state: Sequence[Tensor], layout: Layout | None = None) -> int:
        """Take the fingerprint of ``state`` (cut into rows by ``layout``, default its own);
        returns its index into :meth:`results`."""
        layout = layout_of(state) if layout is None else layout
        rows: list[tuple[Tensor, tuple[Tensor, ...]] | None] = []
        exact: list[Tensor | None] = []
        with _full_precision(state[0].device):
            for x, k in zip(state, layout):
                # This runs for every layer, twice a step: what depends only on the shape is
                # looked up once (on small tensors Python, not the data, is the cost).
                plan = _plans.get((k, x.shape, x.dtype, x.device))
                if plan is None:
                    plan = _plans[(k, x.shape, x.dtype, x.device)] = _Plan.of(x, k)
                if plan.u is None:  # empty
                    rows.append(None)
                    exact.append(None)
                    continue
                slab = _slab(x, plan)
                rows.append((_row_projections(slab, plan), plan.fold))  # W: (A, R, 2)
                # Too few rows for the norm estimate: the exact norm.
                exact.append(torch.linalg.vector_norm(slab) if plan.exact_norm else None)
                self._pending_values += plan.values
        index = self._folded + len(self._pending)
        self._pending.append((len(state), rows, exact))
        if self._pending_values > _MAX_PENDING:
            self._fold()
        return index

    def stacked(self, indices: Sequence[int]) -> Tensor:
        """The fingerprints of the states at ``indices``, stacked: ``(len(indices), n,
        1 + PROJECTIONS)`` for states of ``n`` tensors each (one indexing op in the usual case,
        where every state was folded at once)."""
        self._fold()
        if self._batch is not None:
            return self._batch[list(indices)]
        return torch.stack([self.results()[i] for i in indices])

    def results(self) -> list[Tensor]:
        """Per state added, in order: ``(len(state), 1 + PROJECTIONS)`` float64."""
        self._fold()
        self._split()
        return self._done

    def _split(self) -> None:
        if self._unsplit is not None:
            out, counts = self._unsplit
            self._done.extend(out.split(counts))
            self._unsplit = None

    def _fold(self) -> None:
        if not self._pending:
            return
        flat = [(w, e) for _, rows, exact in self._pending for w, e in zip(rows, exact)]
        groups: dict[tuple, list[int]] = {}
        for j, (row, _) in enumerate(flat):
            if row is not None:  # one group per shape of tensor: the same fold vectors
                groups.setdefault((row[0].shape, id(row[1])), []).append(j)
        counts = [n for n, _, _ in self._pending]
        outs = {}
        for key, members in groups.items():
            w, fold = flat[members[0]][0]  # type: ignore[misc]
            with _full_precision(w.device):
                out = _fold_rows([flat[j][0][0] for j in members], fold)  # type: ignore[index]
            if flat[members[0]][1] is not None:  # too few rows for the estimate (same shapes)
                out[:, 0] = torch.stack([flat[j][1] for j in members]).to(out.dtype)  # type: ignore[misc]
            outs[key] = out
        if len(groups) == 1 and len(flat) == len(next(iter(groups.values()))):
            # The usual case, one shape throughout: each state is a slice of one tensor.
            out = next(iter(outs.values()))
            first_fold = not self._folded
            same = all(n == counts[0] for n in counts)
            self._split()
            if first_fold and same:
                # Per-state views only when asked for (results()); stacked() reads the batch.
                self._batch, self._unsplit = out.view(len(counts), counts[0], -1), (out, counts)
            else:
                self._batch = None
                self._done.extend(out.split(counts))
        else:
            folded: list[Tensor | None] = [None] * len(flat)
            for key, members in groups.items():
                for j, row in zip(members, outs[key].unbind(0)):
                    folded[j] = row
            self._batch = None
            self._split()
            device = next(iter(outs.values())).device if outs else None
            start = 0
            for n in counts:
                self._done.append(_assemble(folded[start : start + n], device))
                start += n
        self._folded += len(counts)
        self._pending, self._pending_values = [], 0


def _full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off (the check's products in the tensors' own precision), where it is on."""
    device_type = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else "cpu"
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _fold_rows(ws: list[Tensor], fold: tuple[Tensor, ...]) -> Tensor:
    """``(len(ws), 1 + PROJECTIONS)`` float64: norm estimates and projections of same-shaped
    row projections ``W`` (``(A, R, 2)`` each), in one or two small matrix products (an einsum
    here cost several times the pass over the data)."""
    w = torch.stack(ws) if len(ws) > 1 else ws[0].unsqueeze(0)  # (n, A, R, 2)
    n, a, rows, _ = w.shape
    if len(fold) == 1:  # s_A ⊗ s_R as one matrix: (n, 2, A·R) @ (A·R, 32)
        projections = torch.matmul(w.view(n, a * rows, ROW_VECTORS).transpose(1, 2), fold[0])
    else:
        s_a, s_r = fold
        across_a = torch.matmul(s_a.T, w.view(n, a, rows * ROW_VECTORS))  # (n, 4, R * 2)
        per_row_vector = across_a.view(n, _FOLD_A, rows, ROW_VECTORS).transpose(2, 3)  # (n, 4, 2, R)
        projections = torch.matmul(per_row_vector, s_r).transpose(1, 2)  # (n, 2, 4, 8)
    norm = torch.linalg.vector_norm(w.view(n, -1), dim=1, keepdim=True)
    return torch.cat([norm, projections.reshape(n, PROJECTIONS)], dim=1).to(torch.float64)


_MAX_KRON_ROWS = 1 << 14
"""Rows (``A·R``) up to which ``s_A ⊗ s_R`` is kept as one matrix (2 MiB in float32)."""


def _assemble(parts: list[Tensor | None], device: torch.device | None) -> Tensor:
    """One state's fingerprint from its tensors' rows (zeros for empty tensors)."""
    zeros = torch.zeros(1 + PROJECTIONS, dtype=torch.float64, device=device)
    return torch.stack([zeros if part is None else part for part in parts])


def fingerprint(state: Sequence[Tensor], layout: Layout | None = None) -> Tensor:
    """``(len(state), 1 + PROJECTIONS)`` float64: each tensor's norm and random projections.

    Args:
        state: The tensors.
        layout: How to cut them into rows (:func:`layout_of`); default: their own layout.
            Compare two fingerprints only when they were taken with the same layout.
    """
    prints = Fingerprints()
    prints.add(state, layout)
    return prints.results()[0]


def norms(state: Sequence[Tensor]) -> Tensor:
    """The norm of each tensor of ``state`` (float64, estimated as in :func:`fingerprint`)."""
    return fingerprint(state)[:, 0]


class RebuildCheck:
    """One layer's forward and rebuilt fingerprints, with what the message needs.

    Args:
        layer: Gives ``drift_tolerance`` and ``drift_action``.
        where: Names the layer in messages (or a function that returns the name).
        before: Fingerprint of the forward's input.
        after: Fingerprint of the rebuilt input.
        output_norms: Norms of the layer's output in the forward (its scale and finiteness).
        output_names: ``(output index, name)`` of what produced each output tensor, in the order
            they are computed, for blame (``((0, "F"), (1, "G"))`` for a block).
    """

    def __init__(
        self,
        layer: object,
        where: str | Callable[[], str],
        before: Tensor,
        after: Tensor,
        output_norms: Tensor,
        output_names: Sequence[tuple[int, str]] | None = None,
    ) -> None:
        self.layer = layer
        self._where = where
        self.before = before
        self.after = after
        self.output_norms = output_norms
        self.output_names = output_names

    @property
    def where(self) -> str:
        """The layer named for messages (built only when a message needs it)."""
        return self._where if isinstance(self._where, str) else self._where()


def check_rebuilds(checks: Sequence[RebuildCheck]) -> list[float]:
    """Compare forward and rebuilt fingerprints of many layers; one device sync in all.

    Non-finite rebuilds raise at once. Errors above tolerance are reported together: one
    :class:`ReconstructionError` (layers with ``drift_action="raise"``) or one warning per run,
    naming the worst layer and how many exceeded their tolerance.

    Returns the estimated relative error per layer (NaN where the forward was not finite).
    """
    if not checks:
        return []
    groups: dict[tuple[int, int, int], list[int]] = {}
    for k, check in enumerate(checks):
        key = (*check.before.shape, check.output_norms.numel())
        groups.setdefault(key, []).append(k)
    errors: list[float] = [math.nan] * len(checks)
    names: list[str] = [""] * len(checks)
    for members in groups.values():
        summary = _summarise(*_on_host(
            torch.stack([checks[k].before for k in members]),
            torch.stack([checks[k].after for k in members]),
            torch.stack([checks[k].output_norms.reshape(-1) for k in members]),
        ))
        group_errors, group_names = _read(summary, lambda m: checks[members[m]])
        for m, k in enumerate(members):
            errors[k], names[k] = group_errors[m], group_names[m]
    _report(errors, names, [c.layer for c in checks], lambda k: checks[k])
    return errors


def check_run(
    layers: Sequence[object],
    where: Callable[[int], str],
    before: Tensor,
    after: Tensor,
    output_norms: Tensor,
) -> list[float]:
    """:func:`check_rebuilds` for layers whose fingerprints are stacked already (an M-mode
    run's checked layers): ``before``/``after`` ``(layers, halves, 1 + PROJECTIONS)``,
    ``output_norms`` ``(layers, m)``; ``where(k)`` names layer ``k``. The arithmetic of all
    layers runs at once on the host (one copy from a GPU, one sync); a
    :class:`RebuildCheck` is made only for a layer a message names (per-layer tensors were
    most of the check's cost on small tensors)."""
    if not layers:
        return []

    def check(k: int) -> RebuildCheck:
        layer = layers[k]
        return RebuildCheck(layer, functools.partial(where, k), before[k], after[k], output_norms[k],
                            getattr(layer, "output_names", None))

    errors, names = _read(_summarise(*_on_host(before, after, output_norms)), check)
    _report(errors, names, layers, check)
    return errors


def _read(summary: np.ndarray, check: Callable[[int], RebuildCheck]) -> tuple[list[float], list[str]]:
    """Errors and the names of the worst halves from :func:`_summarise`'s rows; raises for a
    non-finite rebuild of a finite input."""
    errors: list[float] = [math.nan] * len(summary)
    names: list[str] = [""] * len(summary)
    for k, (finite_before, finite_after, drift, which, halves) in enumerate(summary.tolist()):
        if not finite_before:
            continue  # the forward's input was not finite; the loss shows that already
        if not finite_after:
            bad = check(k)
            _check_one(bad, bad.before.tolist(), bad.after.tolist(), bad.output_norms.flatten().tolist())  # raises
        errors[k] = drift
        names[k] = f"x{int(which) + 1}" if halves > 1 else "x"
    return errors, names


def _report(errors: list[float], names: list[str], layers: Sequence[object], check: Callable[[int], RebuildCheck]) -> None:
    """Warn, or raise for layers with ``drift_action="raise"``, about errors above tolerance."""
    over = [
        (errors[k], k, names[k])
        for k, layer in enumerate(layers)
        if errors[k] > float(getattr(layer, "drift_tolerance"))
    ]
    if over:
        strict = [o for o in over if getattr(layers[o[1]], "drift_action") == "raise"]
        drift, k, name = max(strict or over, key=lambda o: o[0])
        message = _drift_message((drift, check(k), name), len(over), len(errors))
        if strict:
            raise ReconstructionError(message)
        warnings.warn(message, ReconstructionDriftWarning, stacklevel=4)


def _on_host(*tensors: Tensor, gather: bool | None = None) -> list[np.ndarray]:
    """The tensors as float64 arrays in host memory: from a GPU in one copy (one sync), from
    the CPU without a copy. ``gather`` forces the one-copy path (a test runs it on the CPU)."""
    tensors = tuple(t.detach() for t in tensors)
    if not (tensors[0].device.type != "cpu" if gather is None else gather):
        return [t.numpy().astype(np.float64, copy=False) for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    sizes = np.cumsum([t.numel() for t in tensors])[:-1]
    return [part.reshape(t.shape) for part, t in zip(np.split(flat, sizes), tensors)]


def _summarise(before: np.ndarray, after: np.ndarray, out_norms: np.ndarray) -> np.ndarray:
    """Per layer: forward input finite, rebuild finite, largest relative error, its half, and
    the number of halves.

    ``before``/``after``: ``(layers, halves, 1 + PROJECTIONS)``; ``out_norms``: ``(layers, m)``.
    The same arithmetic as :func:`_check_one`, which stays the reference for messages.
    """
    with np.errstate(all="ignore"):  # non-finite values are what this looks for
        finite_before = np.isfinite(before).reshape(len(before), -1).all(axis=1)
        finite_after = np.isfinite(after).reshape(len(after), -1).all(axis=1)
        in_scale = np.sqrt(np.square(before[..., 0]).sum(axis=1))
        out_scale = np.sqrt(np.square(out_norms).sum(axis=1))
        scale = np.fmax(in_scale, out_scale)  # fmax: a non-finite output norm does not poison it
        error = np.sqrt(np.square(after[..., 1:] - before[..., 1:]).mean(axis=-1))
        denominator = np.fmax(before[..., 0], FLOOR * scale[:, None])
        # Input and output exactly zero: any rebuilt value is wrong.
        zero = np.where(error > 0, math.inf, 0.0)
        drift = np.where(denominator == 0, zero, error / np.where(denominator == 0, 1.0, denominator))
        which = np.argmax(drift, axis=1)  # like torch.max: a NaN wins
        worst = np.take_along_axis(drift, which[:, None], axis=1)[:, 0]
    halves = np.full(len(before), before.shape[1])
    return np.stack([finite_before, finite_after, worst, which, halves], axis=1).astype(np.float64)


def _check_one(
    check: RebuildCheck, before: list[list[float]], after: list[list[float]], out_norms: list[float]
) -> tuple[float, str]:
    """The largest estimated relative error over the halves, and which half it is."""
    if not all(math.isfinite(v) for row in before for v in row):
        return math.nan, ""  # the forward's input was not finite; the loss shows that already
    names = [f"x{i + 1}" for i in range(len(before))] if len(before) > 1 else ["x"]
    if not all(math.isfinite(v) for row in after for v in row):
        bad = next(n for n, row in zip(names, after) if not all(math.isfinite(v) for v in row))
        raise ReconstructionError(_non_finite_message(check, bad, out_norms))
    in_scale = math.sqrt(sum(row[0] ** 2 for row in before))
    out_scale = math.sqrt(sum(v * v for v in out_norms))
    scale = max(in_scale, out_scale)
    worst, worst_name = 0.0, names[0]
    for name, b, a in zip(names, before, after):
        error = math.sqrt(sum((x - y) ** 2 for x, y in zip(a[1:], b[1:])) / (len(a) - 1))
        denominator = max(b[0], FLOOR * scale)
        if denominator == 0.0:  # input and output exactly zero: any rebuilt value is wrong
            drift = math.inf if error > 0 else 0.0
        else:
            drift = error / denominator
        if drift > worst:
            worst, worst_name = drift, name
    return worst, worst_name


def _drift_message(worst: tuple[float, RebuildCheck, str], count: int, total: int) -> str:
    drift, check, name = worst
    tolerance = float(getattr(check.layer, "drift_tolerance"))
    others = f" ({count} of {total} checked layers of this run exceed their tolerance)" if count > 1 else ""
    return (
        f"the rebuilt input of {check.where} drifted from the forward's by {drift:.2e} "
        f"(relative error of input {name}, estimated from {PROJECTIONS} random projections) "
        f"> drift_tolerance={tolerance:g}{others}; gradients may be inaccurate. "
        "Use float64, fewer consecutive M-mode layers, C-mode for this layer, or an exact "
        "coupling (coupling='exact'); raise drift_tolerance to accept it" + _tf32_hint(check.before)
    )


def _tf32_hint(fingerprint: Tensor) -> str:
    """On CUDA with TF32 allowed, name it: TF32 rounds what F and G read to 10 mantissa bits, so
    a rebuilt input that differs from the forward's in the last float32 bits can round to
    another TF32 value. On an H100, float32 stacks (revtrain's and the peer libraries' alike)
    showed 10-20x the CPU's gradient error with PyTorch's default settings
    (results/core_stack_cuda_h100.md)."""
    if not fingerprint.is_cuda:
        return ""
    on = [name for name, flag in _tf32_flags() if flag]
    if not on:
        return ""
    return (
        f". TF32 is allowed ({' and '.join(on)} is True): it rounds the inputs of F and G to 10 "
        "mantissa bits, which can magnify rebuild errors; set it to False for M-mode training"
    )


def _tf32_flags() -> list[tuple[str, bool]]:
    """PyTorch's two TF32 switches and their values (False where a build lacks one)."""
    flags = []
    for name, owner, attr in (("torch.backends.cudnn.allow_tf32", torch.backends.cudnn, "allow_tf32"),
                              ("torch.backends.cuda.matmul.allow_tf32", torch.backends.cuda.matmul, "allow_tf32")):
        try:
            flags.append((name, bool(getattr(owner, attr))))
        except (AttributeError, RuntimeError):
            flags.append((name, False))
    return flags


def _non_finite_message(check: RebuildCheck, bad: str, out_norms: list[float]) -> str:
    if not all(math.isfinite(v) for v in out_norms):
        order = check.output_names or [(i, f"output {i + 1}") for i in range(len(out_norms))]
        culprit = next(name for i, name in order if not math.isfinite(out_norms[i]))
        return (
            f"the forward pass of {check.where} already produced non-finite values for a finite "
            f"input: {culprit} returned NaN or inf (the inverse is not at fault; the loss is "
            "non-finite too). Lower the learning rate, check the input scale and what "
            f"{culprit} computes (a log or division of values near 0), or clip gradients"
        )
    return (
        f"rebuilding the input of {check.where} produced non-finite values (input {bad}) although "
        "the forward's input and output were finite: the inverse overflowed or divided by ~0. "
        "Run this layer in C-mode (layer.mode = 'C'), use a bounded coupling scale, a smaller "
        "learning rate, or check it with revtrain.verify_invertible"
    )
