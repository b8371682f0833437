"""The autograd function behind M-mode: a run of reversible layers that keeps one output.

:class:`_ReversibleRun`'s forward runs consecutive M-mode layers without a graph and keeps only
the run's output; its backward walks them in reverse, each layer rebuilding its input and
backpropagating (``step_reverse``: RevNet's Algorithm 1 for a coupling block, ``block.py``), and
hands the rebuilt input to the layer below. The optional pieces are called at fixed points, each
from its own file: the rebuild check (``checks.py``), the hand-over between consecutive runs
(``handoff.py``), the overlapped schedule (``overlap.py``), FSDP2 unsharding (``sharding.py``)
and the forward's tensors for ``functional_call`` (``functional_call.py``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.core.arguments import NO_ARGS, ExtraArgs
from revtrain.core.checks import SAMPLED_CALL, RunCheck
from revtrain.core.handoff import find_producer, keep_saved, kept_tensors, same_views
from revtrain.core.overlap import reverse_overlapped, supports_overlap
from revtrain.core.functional_call import ModuleTensors
from revtrain.core.replay import AutocastState, no_running_stat_updates_of, stat_norms
from revtrain.core.sharding import any_sharded, unsharded
from revtrain.core.step import ReversibleStep, State, StepResult, add_grads, owner_module
from revtrain.errors import ReconstructionError, ReversibilityError

__all__ = ["run_reversible", "run_spec", "check_state"]


def check_state(xs: State) -> None:
    """Raise a clear error when the tensors of a state cannot be mapped together."""
    first = xs[0]
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise ReversibilityError(
                f"reversible layers map tensors; input {i + 1} is a {type(x).__name__}. Pass a "
                "tensor, or a tuple (x1, x2) of tensors for a block called on a pair"
            )
        if not (x.is_floating_point() or x.is_complex()):
            raise ReversibilityError(
                f"reversible layers map floating-point tensors; got a {x.dtype} input of shape "
                f"{tuple(x.shape)}. Token ids or labels go through an embedding first "
                "(nn.Embedding), other integer data through x.float()"
            )
    for i, x in enumerate(xs[1:], start=2):
        if x.device != first.device or x.dtype != first.dtype:
            raise ReversibilityError(
                f"the two halves differ: x1 is {first.dtype} on {first.device}, x{i} is {x.dtype} "
                f"on {x.device}; move both to one device and dtype (e.g. x2 = x2.to(x1)) before "
                "the block"
            )


@dataclass(frozen=True)
class _Run:
    """What one M-mode run is made of (everything but tensors)."""

    layers: tuple[ReversibleStep, ...]
    join_dim: int | None
    param_lists: tuple[list[Tensor], ...]
    n_state: int
    extra: ExtraArgs
    n_extra: int
    module_tensors: ModuleTensors  # what the modules of every layer held (functional_call.py)
    stat_norms: tuple[nn.Module, ...]  # their norm layers that update running statistics
    sharded: bool  # whether a layer is FSDP2-managed (sharding.py)
    overlap: bool = False  # overlap each layer's gradients with the rebuild below (overlap.py)

    def state_of(self, outputs: Sequence[Tensor]) -> State:
        """The output state of the run from its output tensors."""
        if self.join_dim is None:
            return tuple(outputs)
        return tuple(outputs[0].chunk(self.n_state, dim=self.join_dim))


class _ReversibleRun(torch.autograd.Function):
    """Forward: a run of M-mode layers without a graph. Backward: rebuild and backpropagate."""

    @staticmethod
    def forward(ctx, run: _Run, *tensors):  # type: ignore[override]
        xs: State = tensors[: run.n_state]
        extra_in = tensors[run.n_state : run.n_state + run.n_extra]
        extra = run.extra.with_tensors(extra_in) if run.n_extra else run.extra
        layers = run.layers
        records: list[Any] = []
        autocast = AutocastState.capture(xs[0].device)
        check = None if xs[0].is_meta else RunCheck.start(layers, autocast.dtype if autocast.enabled else xs[0].dtype)
        outside = SAMPLED_CALL.set(False)  # a layer's own host-reading checks follow the check
        try:
            for i, layer in enumerate(layers):
                SAMPLED_CALL.set(check is not None and check.due[i])
                ys, record = layer.step_forward(xs, extra)
                if check is not None:
                    check.forward(i, xs, ys)
                xs = ys
                records.append(record)
        finally:
            SAMPLED_CALL.reset(outside)
        ctx.check, ctx.run, ctx.records, ctx.autocast = check, run, records, autocast
        ctx.set_materialize_grads(False)
        outputs = xs if run.join_dim is None else (torch.cat(xs, dim=run.join_dim),)
        # What run_reversible fills in after the call (see _register); a run called any other
        # way (gradcheck) keeps its output plainly and is never taken over.
        ctx.n_outputs = len(outputs)
        ctx.kept_refs = ctx.taker = ctx.handoff = ctx.producer = None
        # Detached aliases share the outputs' version counters (in-place edits stay visible)
        # without the reference cycle that keeping an output on its own node would make.
        ctx.save_for_backward(*(t.detach() for t in outputs), *extra_in)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if torch.is_grad_enabled():  # autograd enables grad mode in backward only for create_graph
            raise ReconstructionError(
                "double backward (create_graph=True) through M-mode reversible blocks is not "
                "supported; run those blocks in C-mode (revtrain.set_modes(model, 'C')) when you "
                "need higher-order gradients"
            )
        run: _Run = ctx.run
        saved = _saved(ctx)
        ys = _output_state(ctx, saved)
        ctx.handoff = None  # used: free it
        saved_extra = saved[ctx.n_outputs :]
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            # No second pass will read the kept output: let it die with the top layer's rebuild
            # instead of at the end of the run (one full output less at the run's peak).
            _release_output(ctx)
        del saved
        if run.join_dim is None:
            dys: tuple[Tensor | None, ...] = grads
        else:
            dys = (None,) * run.n_state if grads[0] is None else grads[0].chunk(run.n_state, dim=run.join_dim)
        first_extra = 1 + run.n_state
        extra = _live_extra(run, saved_extra, ctx.needs_input_grad[first_extra : first_extra + run.n_extra])

        layers = run.layers
        n = len(layers)
        param_grads: list[list[Tensor | None]] = [[] for _ in range(n)]
        extra_grads: list[Tensor | None] = [None] * run.n_extra
        check: RunCheck | None = ctx.check
        need_first = any(ctx.needs_input_grad[1:first_extra])
        # The state and its gradient travel as lists that a step empties once it has taken them:
        # the loop holds no reference to a tensor the step no longer needs.
        state: list[Tensor] = list(ys)
        grad_state: list[Tensor | None] = list(dys)
        del ys, dys

        def on_result(i: int, result: StepResult) -> None:
            nonlocal extra_grads
            param_grads[i] = result.param_grads
            if result.extra_grads:
                extra_grads = [add_grads(a, b) for a, b in zip(extra_grads, result.extra_grads)]
            if check is not None:
                check.rebuilt(i, result.inputs)

        with torch.enable_grad(), ctx.autocast.context(), _as_in_forward(run):
            if run.overlap and supports_overlap(layers):
                state, grad_state = reverse_overlapped(
                    n,
                    lambda i, ys, dys, **hooks: layers[i].step_reverse(  # type: ignore[call-arg]
                        ys, dys, ctx.records[i], run.param_lists[i], i > 0 or need_first, extra, **hooks
                    ),
                    lambda i, ys: layers[i].rebuild_top(ys, ctx.records[i], extra),  # type: ignore[attr-defined]
                    functools.partial(_unsharded, run), state, grad_state, on_result,
                )
            else:
                for i in reversed(range(n)):  # Algorithm 1, layer by layer (block.py)
                    with _unsharded(run, i):
                        result = layers[i].step_reverse(
                            state, grad_state, ctx.records[i], run.param_lists[i], i > 0 or need_first, extra
                        )
                    on_result(i, result)
                    state, grad_state = list(result.inputs), list(result.grad_inputs)
                    del result
        _hand_over(ctx, tuple(state))
        if check is not None:
            # Read here, before the run hands back its gradients: a non-finite rebuild raises
            # before they reach .grad, post-accumulate-grad hooks or a DDP all-reduce.
            check.finish(layers, lambda i: f"block {i} of a run of {n} M-mode blocks ({layers[i].describe()})")
        dxs = tuple(d if ctx.needs_input_grad[1 + k] else None for k, d in enumerate(grad_state))
        flat = [g for layer_grads in param_grads for g in layer_grads]
        return (None, *dxs, *extra_grads, *flat)


def _release_output(ctx: Any) -> None:
    """Drop this run's kept copy of its output (the backward has its own reference now)."""
    for holder in kept_tensors(ctx.kept_refs)[: ctx.n_outputs]:
        if holder is not None:
            holder.drop()


@contextlib.contextmanager
def _as_in_forward(run: _Run) -> Iterator[None]:
    """The rebuilds of the run see its modules as the forward did: same parameters and buffers
    (``functional_call``), norm statistics not updated a second time. Entered once per run."""
    with run.module_tensors.in_place(), no_running_stat_updates_of(run.stat_norms):
        yield


def _unsharded(run: _Run, i: int) -> contextlib.AbstractContextManager[None]:
    """Layer ``i`` whole while it rebuilds, where FSDP2 shards it (one layer at a time)."""
    return unsharded(run.layers[i : i + 1]) if run.sharded else contextlib.nullcontext()


def _live_extra(run: _Run, saved_extra: Sequence[Tensor], needs_grad: Sequence[bool]) -> ExtraArgs:
    """The extra arguments for the rebuild: detached tensors, requiring grad where needed."""
    if not run.n_extra:
        return run.extra
    return run.extra.with_tensors([t.detach().requires_grad_(bool(g)) for t, g in zip(saved_extra, needs_grad)])


# -- what the run kept -------------------------------------------------------------------------


def _saved(ctx: Any) -> tuple[Tensor, ...]:
    """The saved tensors, refusing any that were modified in place since the forward."""
    try:
        saved = ctx.saved_tensors
    except RuntimeError as err:
        if "inplace" not in str(err):
            raise
        raise ReconstructionError(_MODIFIED_OUTPUT) from err
    holders = kept_tensors(ctx.kept_refs)
    if not holders:
        return saved
    for k, holder in enumerate(holders):
        if holder is None or not (holder.modified() or _alive_and_changed(ctx, k, holder)):
            continue
        if k < ctx.n_outputs:
            raise ReconstructionError(_MODIFIED_OUTPUT)
        raise ReconstructionError(
            "a tensor passed to an M-mode reversible block as an extra argument for F and G "
            "was modified in place before backward, so the rebuild cannot replay it; pass a "
            "copy (mask.clone()) or modify it out of place"
        )
    return saved


def _alive_and_changed(ctx: Any, k: int, holder: Any) -> bool:
    """Version check through the caller's own tensor when outer hooks hold the saved copy."""
    if holder.alias is not None or holder.dropped:
        return False
    refs, versions = ctx.input_refs, ctx.input_versions
    t = refs[k]()
    return t is not None and t._version != versions[k]


_MODIFIED_OUTPUT = (
    "the output of an M-mode reversible block was modified in place before backward, "
    "so its input can no longer be rebuilt; use an out-of-place op on the block's "
    "output (e.g. torch.relu(y) instead of y.relu_(), or nn.ReLU(inplace=False) right "
    "after the block), or run that block in C-mode"
)


def _output_state(ctx: Any, saved: Sequence[Tensor]) -> State:
    """The run's output state, from wherever it can be had (see ``core/handoff.py``)."""
    run: _Run = ctx.run
    if ctx.handoff is not None:
        return ctx.handoff
    holders = kept_tensors(ctx.kept_refs)[: ctx.n_outputs]
    if ctx.kept_refs is None or (holders and all(h is not None and not h.dropped for h in holders)):
        return run.state_of([t.detach() for t in saved[: ctx.n_outputs]])
    alive = [ref() for ref in getattr(ctx, "output_refs", ())]
    if alive and all(t is not None and t._version == v for t, v in zip(alive, ctx.output_versions)):
        return run.state_of([t.detach() for t in alive])  # type: ignore[union-attr]
    taker = ctx.taker() if ctx.taker is not None else None
    if taker is not None:
        return _from_taker(ctx, taker, _rebuild_input(taker))
    raise ReconstructionError(
        "the output of an M-mode run was taken over by the M-mode layer it fed (so that chained "
        "blocks keep one output), but that layer is no longer part of any graph and nothing "
        "else kept the output. Keep a reference to the output of the earlier block until "
        "backward, or pass the later block a copy (block(y.clone())) so it does not take the "
        "output over"
    )


def _from_taker(producer: Any, taker: Any, inputs: State) -> State:
    """The taker's rebuilt input as the producer's output state."""
    if taker.producer_link == "state":
        return tuple(inputs)
    value = taker.run.layers[0].from_state(tuple(inputs))
    run: _Run = producer.run
    if run.join_dim is not None:
        return tuple(value.chunk(run.n_state, dim=run.join_dim))
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _hand_over(ctx: Any, inputs: State) -> None:
    """Give the rebuilt input of the run to the run that produced it (it dropped its copy)."""
    producer = ctx.producer
    if producer is not None:
        producer.handoff = _from_taker(producer, ctx, tuple(t.detach() for t in inputs))


def _rebuild_input(node: Any) -> State:
    """The input state of a run, rebuilt from its output without gradients (fallback path)."""
    run: _Run = node.run
    try:
        saved = node.saved_tensors
    except RuntimeError as err:
        raise ReconstructionError(
            "cannot rebuild the input of an M-mode run whose graph was already freed by a "
            "backward pass; pass retain_graph=True to the earlier backward"
        ) from err
    extra_in = saved[node.n_outputs :]
    extra = run.extra.with_tensors([t.detach() for t in extra_in]) if run.n_extra else run.extra
    ys = _output_state(node, saved)
    with torch.no_grad(), node.autocast.context(), _as_in_forward(run):
        for i in reversed(range(len(run.layers))):
            with _unsharded(run, i):
                result = run.layers[i].step_reverse(
                    ys, (None,) * len(ys), node.records[i], run.param_lists[i], False, extra
                )
            ys = result.inputs
    return ys


# -- the entry point ---------------------------------------------------------------------------


def _not_traced_by_compile(fn: Any) -> Any:
    """``torch.compiler.disable(fn)``, made once ``torch.compile`` has loaded Dynamo: loading it
    slows every process's start (ranks, the command line), and eager training never needs it."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        disabled = _DISABLED.get(fn)
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # nothing can be tracing this call
                return fn(*args, **kwargs)
            disabled = _DISABLED[fn] = torch.compiler.disable(fn)  # under a trace: a graph break
        return disabled(*args, **kwargs)

    return call


_DISABLED: dict[Any, Any] = {}


@_not_traced_by_compile
def run_reversible(
    layers: Sequence[ReversibleStep],
    xs: State,
    join_dim: int | None,
    extra: ExtraArgs = NO_ARGS,
    source: Any = None,
    overlap: bool = False,
) -> Tensor | State:
    """Run consecutive M-mode layers on the state ``xs``.

    Args:
        layers: The layers, in order.
        xs: The input state.
        join_dim: None to return the output state (one tensor for a one-tensor state), or the
            dimension to concatenate its tensors along (saved once, inside the function).
        extra: Extra arguments for ``F`` and ``G`` of every layer.
        source: What the caller was called with, when ``xs`` is just ``layers[0].to_state`` of
            it: a run that produced exactly that is taken over (None: never).
        overlap: Overlap each layer's gradients with the rebuild of the layer below
            (``core/overlap.py``; layers without phases run one after the other).

    ``torch.compile`` of a model does not trace into a run (its Python, the check and the
    hand-over are not graph material): the run is a graph break and runs eagerly, so no guard
    of it recompiles; ``revtrain.compile_model`` compiles ``F`` and ``G`` themselves.
    """
    if torch._C._are_functorch_transforms_active():
        raise ReversibilityError(
            "M-mode reversible layers cannot run under torch.func transforms (grad, vmap, "
            "jacrev, ...): their backward rebuilds inputs outside the transform. Run them in "
            "C-mode for this call (revtrain.set_modes(model, 'C')); torch.func.functional_call "
            "alone is supported in M-mode"
        )
    # Parameters are inputs of the function so that autograd routes their gradients; the
    # lists are collected once here and reused by backward. FSDP2-sharded layers are made
    # whole first, so the lists hold the parameters F and G really use (core/sharding.py).
    with unsharded(layers):
        run = run_spec(layers, len(xs), join_dim, extra, overlap)
        params = [p for plist in run.param_lists for p in plist]
        with keep_saved() as holders:
            out = _ReversibleRun.apply(run, *xs, *extra.tensors, *params)
    outputs = out if isinstance(out, tuple) else (out,)
    node = outputs[0].grad_fn
    if isinstance(node, _ReversibleRun._backward_cls):
        _register(node, outputs, holders, xs, extra, source)
    return out


def run_spec(
    layers: Sequence[ReversibleStep],
    n_state: int,
    join_dim: int | None = None,
    extra: ExtraArgs = NO_ARGS,
    overlap: bool = False,
) -> _Run:
    """The non-tensor first argument of ``_ReversibleRun.apply`` (the tensors follow: the
    state, the extra arguments' tensors, then every layer's ``step_params()``)."""
    # One walk per layer's module serves both hooks (this runs on every M-mode forward).
    modules = [m for layer in layers if (owner := owner_module(layer)) is not None for m in owner.modules()]
    return _Run(
        layers=tuple(layers),
        join_dim=join_dim,
        param_lists=tuple(layer.step_params() for layer in layers),
        n_state=n_state,
        extra=extra,
        n_extra=len(extra.tensors),
        module_tensors=ModuleTensors.capture(modules),
        stat_norms=tuple(dict.fromkeys(stat_norms(modules))),
        sharded=any_sharded(layers),
        overlap=overlap,
    )


def _register(
    node: Any, outputs: Sequence[Tensor], holders: list | None, xs: State, extra: ExtraArgs, source: Any
) -> None:
    node.kept_refs = [weakref.ref(h) for h in holders] if holders is not None else None
    node.output_refs = [weakref.ref(t) for t in outputs]
    node.output_versions = [t._version for t in outputs]
    # For version checks where the caller's saved-tensor hooks hold the copies.
    node.input_refs = node.output_refs + [weakref.ref(t) for t in extra.tensors]
    node.input_versions = node.output_versions + [t._version for t in extra.tensors]
    if source is None or holders is None:
        return
    producer = find_producer(source, _ReversibleRun._backward_cls)
    if producer is None:
        return
    sources = source if isinstance(source, (tuple, list)) else (source,)
    node.producer_link = "state" if same_views(producer.run.state_of(sources), xs) else "value"
    node.producer = producer
    producer.taker = weakref.ref(node)
    for holder in kept_tensors(producer.kept_refs)[: producer.n_outputs]:
        if holder is not None:
            holder.drop()  # the taker rebuilds it in backward
