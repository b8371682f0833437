"""Fingerprints of tensors: random projections that see an error in any direction.

A fingerprint of a tensor ``x`` is :data:`PROJECTIONS` random projections of it and an estimate
of its norm, from one pass over the data. ``x`` is seen (as a view, no copy) as ``A × R`` rows
of ``L`` contiguous values; one product gives each row's projection onto two fixed random
vectors ``u_1, u_2`` (``W = X u``, two numbers per row), and fixed random vectors across ``A``
(4) and across ``R`` (8) fold those into 2 × 4 × 8 numbers. Each projection is onto a rank-one
random tensor ``s_A ⊗ s_R ⊗ u``, whose projection of an error ``E`` has mean square ``‖E‖²``;
the root mean square of the differences over all projections estimates ``‖Δx‖`` in whatever
direction the error lies. (A norm alone misses errors orthogonal to ``x``: a 1% random error
moves the norm by 1e-4, a rotation not at all.) Two vectors ``u`` keep an error that is the same
in every row (a per-channel offset) from hiding in the one direction a single ``u`` cannot see.
The norm estimate is ``‖W‖ / √2`` (within a few percent for hundreds of rows); rows are made
no longer than leaves :data:`EXACT_NORM_ROWS` of them where the strides allow, and smaller
tensors pay one more pass for the exact norm. The random vectors are drawn once per shape from
a fixed seed (never from torch's global generators) and cached.

The pass over the data and the fold are separate (:class:`Fingerprints`): each state costs one
product per tensor when it is taken, and the fold runs once for all the states of a run, in
the tensors' own precision whatever the autocast setting. On small tensors the cost is the
number of ops, not the data: this cut it from ~15 ops per state to 2. Backward compares rebuilt
states without forming their fingerprints: one product folds a group's row projections and
subtracts the forward's projections (:func:`projection_errors`). On CPUs, tensors from
32K values take the product transposed (``u^T X^T``, two rows against the data,
:func:`_row_projections`): MKL's two-column product ``X u`` ran at a fraction of memory speed.

``core/checks.py`` compares the fingerprints a rebuild gives with the forward's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from revtrain.core.replay import autocast_device_type

__all__ = [
    "fingerprint", "Fingerprints", "layout_of", "Layout", "PROJECTIONS", "EXACT_NORM_ROWS", "FOLD_EVERY",
    "comparable_plan", "row_projections", "projection_errors", "transposed_projections", "take_rows",
]

ROW_VECTORS = 2
"""Random vectors along the rows (both applied in one batched matrix product)."""

PROJECTIONS = 64
"""Random projections per tensor: 2 row vectors x 4 vectors across ``A`` x 8 across ``R``."""

EXACT_NORM_ROWS = 64
"""Below this many rows the norm estimate is too rough: compute the norm exactly."""

_MAX_ROW = 4096
_SEED = 0x5EED
_FOLD_A, _FOLD_R = 4, 8  # random vectors across the two row dimensions: 2 x 4 x 8 = 64 projections
_vectors: dict[tuple[int, int, int, torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor, Tensor]] = {}

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
    key = tuple([(x.shape, x.stride()) for x in state])  # all _row_start reads
    layout = _layouts.get(key)
    if layout is None:
        if len(_layouts) >= _MAX_CACHED:
            _layouts.clear()
        layout = _layouts[key] = tuple(_row_start(x) for x in state)
    return layout


_layouts: dict[tuple, Layout] = {}


def _slab_shape(x: Tensor, k: int) -> tuple[int, int, int]:
    """``(A, R, L)``: dims ``[0, k-1)``, dim ``k-1`` and dims ``[k, ...)`` of ``x`` merged."""
    if x.dim() < 2:
        return (1, 1, x.numel())
    return (math.prod(x.shape[: k - 1]), x.shape[k - 1], math.prod(x.shape[k:]))


def _random_vectors(
    a: int, rows: int, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The row vectors ``u / sqrt(ROW_VECTORS)`` as ``(A, L, 2)`` for a batched product and
    transposed, ``(A, 2, L)`` (a broadcast view of one contiguous ``(2, L)``),
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
        u, s_a, s_r = (t.to(device=device, dtype=dtype) for t in (u / root, s_a, s_r * root))
        # A contiguous batch of u's multiplies faster than a broadcast view (small tensors are
        # bound by per-op cost); large batches keep the view instead of a large copy.
        batched = u.expand(a, length, ROW_VECTORS)
        transposed = u.T.contiguous().expand(a, ROW_VECTORS, length)
        cached = (batched.contiguous() if batched.numel() <= _MAX_PENDING else batched, transposed, s_a, s_r)
        _vectors[key] = cached
    return cached


def _row_vectors(length: int, gen: torch.Generator) -> Tensor:
    """``(L, 2)`` float64: two random vectors along the rows whose sums are ``sqrt(L)``.

    For even ``L`` they come from ``L/2`` random complex numbers ``a_k + i b_k``: ``v1`` holds
    ``(a_k, -b_k)`` and ``v2`` holds ``(b_k, a_k)`` interleaved (exactly orthogonal; they were
    built this way for a complex multiply-and-sum that the transposed product has replaced, and
    kept so that fingerprints, and the calibration in ``benchmarks/rebuild_check.py``, stay the
    same). ``Σa = sqrt(L)`` and ``Σb = 0`` make both sums ``sqrt(L)``: see :func:`_typical_sums`
    for why the sums are fixed.
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
    u_t: Tensor | None
    """The same transposed, ``(A, 2, L)``, for CPU and CUDA tensors from :data:`_TRANSPOSED_MIN`
    values (None otherwise)."""
    fold: tuple[Tensor, ...] | None
    """How :func:`_fold_rows` folds ``W``: ``(s_A ⊗ s_R,)`` as one ``(A·R, 32)`` matrix, or
    ``(s_A, s_R)`` where that matrix would be large."""
    exact_norm: bool
    """Too few rows for the norm estimate."""
    values: int
    """Values of ``W`` it produces."""
    fold_batches: dict[int, Tensor]
    """``(s_A ⊗ s_R)^T`` as a batch of ``m``, per ``m`` (:func:`projection_errors`): expanded views
    of one contiguous copy of the transposed fold matrix (kept under ``0``), made on first use
    and freed with the plan."""

    @classmethod
    def of(cls, x: Tensor, k: int) -> _Plan:
        a, r, length = _slab_shape(x, k)
        upcast = x.dtype in (torch.float16, torch.bfloat16)
        if not x.numel():
            return cls((a, r, length), upcast, None, None, None, False, 0, {})
        u, u_t, s_a, s_r = _random_vectors(a, r, length, torch.float32 if upcast else x.dtype, x.device)
        if x.device.type not in _TRANSPOSED_DEVICES or x.numel() < _TRANSPOSED_MIN:
            # On small tensors the batched product is the faster of the two (inside a CPU step;
            # on an H100 as fast and 1-3 µs less host time); devices not measured take it too.
            u_t = None
        if a * r <= _MAX_KRON_ROWS:  # one product folds W (4 ops fewer, for small tensors)
            fold: tuple[Tensor, ...] = (torch.einsum("ap,rq->arpq", s_a, s_r).reshape(a * r, _FOLD_A * _FOLD_R),)
        else:
            fold = (s_a, s_r)
        return cls((a, r, length), upcast, u, u_t, fold, a * r < EXACT_NORM_ROWS, a * r * ROW_VECTORS, {})


_plans: dict[tuple[int, torch.Size, torch.dtype, torch.device], _Plan] = {}


def _slab(x: Tensor, plan: _Plan) -> Tensor:
    """``x`` as its plan's ``(A, R, L)`` slab (:func:`_slab_shape`).

    A view where strides allow (a half split off a contiguous ``(B, C, H, W)`` tensor is the view
    ``(B, C/2, H·W)``; a half of ``(B, T, D)`` split on the last dimension ``(B, T, D/2)``), a
    copy otherwise (a strided tensor fingerprinted with another tensor's layout).
    """
    if x.requires_grad:
        x = x.detach()
    try:
        slab = x.view(plan.shape)
    except RuntimeError:  # a strided tensor fingerprinted with another tensor's layout
        slab = x.reshape(plan.shape)
    return slab.float() if plan.upcast else slab


def _row_projections(slab: Tensor, plan: _Plan) -> Tensor:
    """``W = X u``: ``(A, R, 2)``, each row's projections onto the two row vectors.

    On CPUs and CUDA GPUs, from :data:`_TRANSPOSED_MIN` values, computed transposed: ``u^T X^T``, two rows of
    length ``L`` against the data, whatever its strides (``W`` comes back as a transposed view).
    MKL's product with two columns ran at a fraction of memory speed (600 µs for a
    (32, 32, 1024) float32 slab alone; the transposed product 150 µs). Measured inside a step
    (``python benchmarks/fingerprint_products.py``, ``results/fingerprint_products_cpu.md``):
    right after the state is computed it is the fastest of the batched, transposed and complex
    multiply-and-sum products from 64K values on (at 524K values 10–114 µs against 150–188 for
    the complex path this replaced and 292–342 for the batched one), the batched one below
    (at 4K, 18 against 33 µs); whole M-mode steps ran 3–5% faster than with the complex path
    at three of four shapes with such halves (1% slower at the fourth, within noise), and the
    transposed product needs no temporary.
    """
    if plan.u_t is not None:
        return torch.bmm(plan.u_t, slab.transpose(1, 2)).transpose(1, 2)
    return torch.bmm(slab, plan.u)  # type: ignore[arg-type]


_TRANSPOSED_MIN = 1 << 15
"""Values from which a CPU or CUDA tensor takes the transposed product of :func:`_row_projections`
(the batched product is faster at 4K values, the transposed one at 64K and above)."""

_TRANSPOSED_DEVICES = ("cpu", "cuda")
"""Devices where the transposed product was measured faster for large tensors. On an H100
(torch 2.11, device time per product; ``results/fingerprint_products_cuda_h100.md``): 55 against
69 µs for a (256, 128, 1024) float32 half (134 MB; 45 µs at memory speed), 30 against 51 µs at
(128, 128, 1024); at (32, 32, 1024) within noise (17–25 against 22–23 µs over three runs)."""

FOLD_EVERY = 4
"""Rebuilt states whose row projections M-mode backward compares together (one
:func:`projection_errors` for states of one plan; fewer ops per state the more, but ``W`` of a
small tensor outweighs its fingerprint and waits through backward's peak: at batch 8, 8
channels, 8×8 a half's ``W`` is 512 bytes against 260 folded; at batch 8, 16 channels, 8×8,
depth 16 folding every 4 states took the step's peak from 319 to 314 KiB for ~2% of its time,
and comparing them at once instead of keeping their fingerprints to 307.7 KiB)."""

_MAX_PENDING = 1 << 16
"""Row projections (values) kept before :class:`Fingerprints` folds them: 256 KiB in float32."""


class _StatePlan(NamedTuple):
    """How to fingerprint a state of given shapes, dtypes, devices and layout (looked up once
    per state: on small tensors Python, not the data, is the check's cost)."""

    plans: tuple[_Plan, ...]
    """Per tensor."""
    device_type: str
    """The tensors' device type as autocast names it (autocast is switched off there around the
    products, where it is on)."""
    shared: _Plan | None
    """The one plan of every tensor, where they share one and are not empty: such states fold
    as one batch (:meth:`Fingerprints._fold`)."""
    exact_norm: bool
    """Some tensor has too few rows for the norm estimate."""
    values: int
    """Values of ``W`` a state produces."""

    @classmethod
    def of(cls, state: Sequence[Tensor], layout: Layout) -> _StatePlan:
        plans = []
        for x, k in zip(state, layout):
            plan = _plans.get((k, x.shape, x.dtype, x.device))
            if plan is None:
                plan = _plans[(k, x.shape, x.dtype, x.device)] = _Plan.of(x, k)
            plans.append(plan)
        shared = plans[0] if plans[0].u is not None and all(p is plans[0] for p in plans) else None
        return cls(tuple(plans), autocast_device_type(state[0].device.type), shared, any(p.exact_norm for p in plans), sum(p.values for p in plans))


_state_plans: dict[tuple, _StatePlan] = {}
_MAX_CACHED = 4096
"""Entries kept by the per-shape caches (states of ever new shapes start them afresh)."""


def _state_plan(state: Sequence[Tensor], layout: Layout) -> _StatePlan:
    key = (layout, *[(x.shape, x.dtype, x.device) for x in state])
    plan = _state_plans.get(key)
    if plan is None:
        if len(_state_plans) >= _MAX_CACHED:
            _state_plans.clear()
        plan = _state_plans[key] = _StatePlan.of(state, layout)
    return plan


class Fingerprints:
    """Fingerprints of many states, each read once when added and folded together later.

    :meth:`add` does the one pass over a state's data (a batched matrix product per tensor,
    giving its row projections ``W``); the few small ops that fold ``W`` into norms and
    projections run once for several states (on small tensors the number of ops, not the data,
    is the check's cost): when :data:`_MAX_PENDING` values of ``W`` wait, and when the results
    are read (:meth:`stacked`, :meth:`take`, :meth:`results`). The forward reads once per run.
    M-mode backward (``RunCheck`` in ``core/checks.py``) compares rebuilt states of one plan by
    their row projections (:func:`row_projections`, :func:`projection_errors`) and takes only
    other states through here, every :data:`FOLD_EVERY`.
    """

    def __init__(self) -> None:
        self._done: list[Tensor] = []  # per state folded, once split (see _batches)
        self._folded = 0  # states folded
        # While every state has the same number of tensors: the folded batches, (states, n, 1 + P)
        # each, not yet split into _done (stacked() reads them directly).
        self._batches: list[Tensor] | None = []
        # Per state: its plan, W per tensor (None when empty) and the exact norms (None where
        # the estimate serves, or for all tensors when none needs one).
        self._pending: list[tuple[_StatePlan, list[Tensor | None], list[Tensor | None] | None]] = []
        self._pending_values = 0

    def add(self, state: Sequence[Tensor], layout: Layout | None = None) -> int:
        """Take the fingerprint of ``state`` (cut into rows by ``layout``, default its own);
        returns its index into :meth:`results`."""
        plan = _state_plan(state, layout_of(state) if layout is None else layout)
        with _full_precision(plan.device_type):  # the products in the tensors' precision
            rows, exact = _products(state, plan)
        index = self._folded + len(self._pending)
        self._pending.append((plan, rows, exact))
        self._pending_values += plan.values
        if self._pending_values > _MAX_PENDING:
            self._fold()
        return index

    def stacked(self, indices: Sequence[int]) -> Tensor:
        """The fingerprints of the states at ``indices``, stacked: ``(len(indices), n,
        1 + PROJECTIONS)`` for states of ``n`` tensors each (one concatenation and one indexing
        op in the usual case, where the states have the same number of tensors)."""
        self._fold()
        if self._batches:
            batch = self._batches[0] if len(self._batches) == 1 else torch.cat(self._batches)
            return take_rows(batch, indices)
        return torch.stack([self.results()[i] for i in indices])

    def take(self) -> Tensor | None:
        """Hand over, stacked as in :meth:`stacked`, the fingerprints of every state added
        since the last call (None if none); they are not kept. For states of the same number
        of tensors."""
        self._fold()
        if self._batches:
            taken = self._batches[0] if len(self._batches) == 1 else torch.cat(self._batches)
        elif self._done:
            taken = torch.stack(self._done)
        else:
            return None
        self._batches, self._done = [], []
        return taken

    def results(self) -> list[Tensor]:
        """Per state added, in order: ``(len(state), 1 + PROJECTIONS)``, in the precision of
        the products (float64 for float64 tensors, float32 otherwise)."""
        self._fold()
        self._split()
        return self._done

    def _split(self) -> None:
        """Per-state views of the batches, from here on (states of another length follow)."""
        for batch in self._batches or ():
            self._done.extend(batch.unbind(0))
        self._batches = None

    def _fold(self) -> None:
        if not self._pending:
            return
        pending = self._pending
        first = pending[0][0]
        # Where the plan changes: the usual run has one plan throughout, or two where the first
        # state's halves, cut by ``chunk`` from the input, have other strides and so other rows.
        ends = [k for k in range(1, len(pending)) if pending[k][0] is not pending[k - 1][0]] + [len(pending)]
        if (
            self._batches is not None
            and len(ends) <= _MAX_STRETCHES
            and _batchable(first, [p for p, _, _ in pending], self._batches)
        ):
            # The states are rows of batches, one per stretch of states of one plan.
            start = 0
            for end in ends:
                self._batches.append(_fold_stretch(pending[start:end]))
                start = end
        else:
            self._fold_mixed()
        self._folded += len(pending)
        self._pending, self._pending_values = [], 0

    def _fold_mixed(self) -> None:
        """States of several shapes or lengths: one fold per shape of tensor."""
        flat = [
            (w, p, None if exact is None else exact[j])
            for plan, rows, exact in self._pending
            for j, (w, p) in enumerate(zip(rows, plan.plans))
        ]
        groups: dict[int, list[int]] = {}
        for j, (w, plan, _) in enumerate(flat):
            if w is not None:  # one group per plan: the same fold vectors
                groups.setdefault(id(plan), []).append(j)
        self._split()
        folded: list[Tensor | None] = [None] * len(flat)
        device = None
        for members in groups.values():
            plan = flat[members[0]][1]
            exact = [flat[j][2] for j in members] if plan.exact_norm else None
            out = _fold_group(plan, [flat[j][0] for j in members], exact)  # type: ignore[misc, arg-type]
            device = out.device
            for j, row in zip(members, out.unbind(0)):
                folded[j] = row
        start = 0
        for plan, _, _ in self._pending:
            count = len(plan.plans)
            self._done.append(_assemble(folded[start : start + count], device))
            start += count


_MAX_STRETCHES = 3
"""Stretches of one plan folded as batches at most; states whose plans change more often (no run
of a stack seen so far) fold once per plan instead (:meth:`Fingerprints._fold_mixed`)."""


def _batchable(first: _StatePlan, plans: list[_StatePlan], batches: list[Tensor]) -> bool:
    """Whether states of these plans fold into batches that :meth:`Fingerprints.stacked`
    concatenates: each state's tensors share one plan, and every state has as many tensors, of
    one dtype and device, as the batches so far."""
    shared = first.shared
    if shared is None:
        return False
    n, dtype, device = len(first.plans), shared.u.dtype, shared.u.device  # type: ignore[union-attr]
    if batches and (batches[0].shape[1] != n or batches[0].dtype != dtype or batches[0].device != device):
        return False
    for plan in plans:
        if plan is not first and (
            plan.shared is None or len(plan.plans) != n
            or plan.shared.u.dtype != dtype or plan.shared.u.device != device  # type: ignore[union-attr]
        ):
            return False
    return True


def _fold_stretch(pending: list[tuple[_StatePlan, list[Tensor | None], list[Tensor | None] | None]]) -> Tensor:
    """``(states, n, 1 + PROJECTIONS)``: the fingerprints of consecutive states of one plan."""
    plan = pending[0][0]
    shared = plan.shared
    ws = [w for _, rows, _ in pending for w in rows]
    exact = [e for _, _, norms in pending for e in norms] if shared.exact_norm else None  # type: ignore[union-attr, misc]
    out = _fold_group(shared, ws, exact)  # type: ignore[arg-type]
    return out.view(len(pending), len(plan.plans), -1)


def _fold_group(plan: _Plan, ws: list[Tensor], exact: list[Tensor] | None) -> Tensor:
    """Fingerprints ``(len(ws), 1 + PROJECTIONS)`` of same-planned tensors from their row
    projections, in the products' precision; ``exact``: their exact norms where the plan has
    too few rows for the estimate (None otherwise)."""
    with _full_precision(ws[0].device.type):
        out = _fold_rows(ws, plan.fold)  # type: ignore[arg-type]
    if exact is not None:
        out[:, 0] = torch.stack(exact).to(out.dtype)
    return out


def _products(state: Sequence[Tensor], plan: _StatePlan) -> tuple[list[Tensor | None], list[Tensor | None] | None]:
    """The pass over a state's data: ``W`` per tensor, and exact norms where rows are few."""
    if not plan.exact_norm:
        return [None if p.u is None else _row_projections(_slab(x, p), p) for x, p in zip(state, plan.plans)], None
    rows: list[Tensor | None] = []
    exact: list[Tensor | None] = []
    for x, p in zip(state, plan.plans):
        if p.u is None:  # empty
            rows.append(None)
            exact.append(None)
            continue
        slab = _slab(x, p)
        rows.append(_row_projections(slab, p))
        exact.append(torch.linalg.vector_norm(slab) if p.exact_norm else None)
    return rows, exact


def comparable_plan(state: Sequence[Tensor], layout: Layout, dtype: torch.dtype) -> _Plan | None:
    """The one plan of a state whose rebuilt row projections :func:`projection_errors` can
    compare directly with fingerprints of ``dtype``: tensors of one non-empty shape whose fold
    is one matrix (the usual state of a stack) and whose products run in ``dtype``; None for any
    other state (a two-factor fold, mixed shapes, a rebuild in another precision than the
    forward's: it goes through :class:`Fingerprints`)."""
    shared = _state_plan(state, layout).shared
    if shared is None or len(shared.fold) != 1 or shared.u.dtype != dtype:  # type: ignore[arg-type, union-attr]
        return None
    return shared


def row_projections(state: Sequence[Tensor], plan: _Plan) -> list[Tensor]:
    """``W`` of each tensor of a state whose tensors share ``plan`` (the pass over the data,
    without the norms: a rebuilt state's fingerprint is compared by its projections)."""
    with _full_precision(state[0].device.type):
        return [_row_projections(_slab(x, plan), plan) for x in state]


def projection_errors(ws: list[Tensor], plan: _Plan, before_t: Tensor, out: Tensor) -> None:
    """Compare rebuilt states with the forward's fingerprints in one product.

    ``ws``: the row projections of ``n`` rebuilt states of ``h`` tensors each, state by state
    (:func:`row_projections`); ``before_t``: the forward's projections of those states as
    :func:`transposed_projections` gives them, ``(n·h, PROJECTIONS / 2, 2)``. Fills ``out``
    ``(n, h)`` with each tensor's verdict: the root sum of squares of its projections'
    differences, summed in ``out``'s dtype (float64 in ``core/checks.py``: non-finite exactly
    where a rebuilt projection is, and a non-finite value in the data makes its projections
    non-finite). The fold and the difference are one ``baddbmm``, ``(s_A ⊗ s_R)^T W -
    p_before``; the rebuilt fingerprints themselves are never formed. Inside an M-mode step each
    small op costs several times what it costs alone (a small step's comparisons took 3% of it
    when they were ~15 ops per group): here one stack, one view, the product and the norm, with
    the fold's transposed batch cached per plan and group size and ``before_t`` a slice of a
    view taken once per run.
    """
    m = before_t.shape[0]
    with _full_precision(before_t.device.type):
        w = torch.stack(ws)  # (n * h, A, R, 2), contiguous whatever the products' strides
        diff = torch.baddbmm(before_t, _batched_fold_t(plan, m), w.view(m, -1, ROW_VECTORS), beta=-1)
        torch.linalg.vector_norm(diff.view(*out.shape, PROJECTIONS), dim=-1, dtype=out.dtype, out=out)


def transposed_projections(prints: Tensor) -> Tensor:
    """The projections of fingerprints ``(n, h, 1 + PROJECTIONS)`` as :func:`projection_errors`
    reads them: ``(n·h, PROJECTIONS / 2, 2)``, a view (two ops; take it once per run and slice
    it, ``h`` rows per state)."""
    n, h = prints.shape[0], prints.shape[1]
    return prints[..., 1:].reshape(n * h, ROW_VECTORS, -1).transpose(1, 2)


def _batched_fold_t(plan: _Plan, m: int) -> Tensor:
    """``(s_A ⊗ s_R)^T`` of a plan whose fold is one matrix, as a batch of ``m``: an expanded view
    of one contiguous copy of the transposed fold, both kept on the plan (one op per comparison
    fewer; freed with the plan)."""
    batch = plan.fold_batches.get(m)
    if batch is None:
        fold_t = plan.fold_batches.get(0)
        if fold_t is None:  # one contiguous copy per plan (a transposed operand ran 1% slower)
            (fold,) = plan.fold  # type: ignore[misc]
            fold_t = plan.fold_batches[0] = fold.T.contiguous()
        batch = plan.fold_batches[m] = fold_t.expand(m, *fold_t.shape)
    return batch


def _full_precision(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off (the check's products in the tensors' own precision), where it is on; else
    one shared do-nothing context (this runs per state: nothing is built where autocast is off)."""
    device_type = autocast_device_type(device_type)
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()


def _fold_rows(ws: list[Tensor], fold: tuple[Tensor, ...]) -> Tensor:
    """``(len(ws), 1 + PROJECTIONS)``: norm estimates and projections of same-shaped
    row projections ``W`` (``(A, R, 2)`` each), in one or two small matrix products (an einsum
    here cost several times the pass over the data)."""
    # (n, A, R, 2); one W may be a transposed view (the CPU's transposed product): reshape below.
    w = torch.stack(ws) if len(ws) > 1 else ws[0].unsqueeze(0)
    n, a, rows, _ = w.shape
    if len(fold) == 1:  # s_A ⊗ s_R as one matrix: (n, 2, A·R) @ (A·R, 32)
        projections = torch.matmul(w.reshape(n, a * rows, ROW_VECTORS).transpose(1, 2), fold[0])
    else:
        s_a, s_r = fold
        across_a = torch.matmul(s_a.T, w.reshape(n, a, rows * ROW_VECTORS))  # (n, 4, R * 2)
        per_row_vector = across_a.view(n, _FOLD_A, rows, ROW_VECTORS).transpose(2, 3)  # (n, 4, 2, R)
        projections = torch.matmul(per_row_vector, s_r).transpose(1, 2)  # (n, 2, 4, 8)
    norm = torch.linalg.vector_norm(w.reshape(n, -1), dim=1, keepdim=True)
    # Kept in the products' precision: float64 would add no information to float32 products and
    # double the check's state (1040 → 520 bytes per block of two float32 halves).
    return torch.cat([norm, projections.reshape(n, PROJECTIONS)], dim=1)


_MAX_KRON_ROWS = 1 << 14
"""Rows (``A·R``) up to which ``s_A ⊗ s_R`` is kept as one matrix (2 MiB in float32)."""


def take_rows(t: Tensor, rows: Sequence[int]) -> Tensor:
    """``t[rows]`` along the first dimension without a host-device sync (negative rows count
    from the end; a row out of range raises :class:`IndexError` on the host, for GPU tensors too).

    Indexing a GPU tensor with a Python list copies the list to the device and waits for the
    copy (a ``cudaStreamSynchronize`` mid-step: two per M-mode step on an H100 before this, in
    ``results/step_profile_*_cuda.md``). Rows in order, one after the other, are a view; the
    same in reverse order a flipped copy; others on a GPU an ``index_select`` with an index
    tensor kept on the device per pattern (:data:`_MAX_CACHED` of them: runs whose layers
    check on different steps repeat a few).
    """
    n = len(rows)
    if n:
        size, low, high = t.shape[0], min(rows), max(rows)
        if low < -size or high >= size:  # as t[rows]; a slice would silently come out short
            raise IndexError(f"row {low if low < -size else high} is out of range for a tensor of {size} rows")
        if low < 0:  # counted from the end, as t[rows] reads them (a slice would not)
            rows = [r + size if r < 0 else r for r in rows]
        first, last = rows[0], rows[-1]
        if abs(last - first) == n - 1 and all(abs(b - a) == 1 and (b > a) == (last > first) for a, b in zip(rows, rows[1:])):
            if last >= first:
                return t[first : last + 1]
            return t[last : first + 1].flip(0)
    if t.device.type == "cpu":
        return t[list(rows)]
    key = (tuple(rows), t.device)
    index = _row_indices.get(key)
    if index is None:
        if len(_row_indices) >= _MAX_CACHED:
            _row_indices.clear()
        index = _row_indices[key] = torch.tensor(key[0], dtype=torch.long, device=t.device)
    return t.index_select(0, index)


_row_indices: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _assemble(parts: list[Tensor | None], device: torch.device | None) -> Tensor:
    """One state's fingerprint from its tensors' rows (zeros for empty tensors)."""
    dtype = next((part.dtype for part in parts if part is not None), torch.float32)
    zeros = torch.zeros(1 + PROJECTIONS, dtype=dtype, device=device)
    return torch.stack([zeros if part is None else part for part in parts])


def fingerprint(state: Sequence[Tensor], layout: Layout | None = None) -> Tensor:
    """``(len(state), 1 + PROJECTIONS)``: each tensor's norm and random projections (float64 for
    float64 tensors, float32 otherwise).

    Args:
        state: The tensors.
        layout: How to cut them into rows (:func:`layout_of`); default: their own layout.
            Compare two fingerprints only when they were taken with the same layout.
    """
    prints = Fingerprints()
    prints.add(state, layout)
    return prints.results()[0]
