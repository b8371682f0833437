"""Peak-memory measurement on CPU and CUDA, in one place.

Every memory number revtrain reports (benchmarks, the planner's profile, tests that
prove "memory does not grow with depth") comes from :func:`track_peak_memory`:

* **CUDA** — the caching allocator's own counters: ``reset_peak_memory_stats`` at entry,
  ``max_memory_allocated`` at exit, both relative to ``memory_allocated`` at entry.
  These are the bytes of live tensor blocks (rounded up to the allocator's 512-byte
  granularity), not the bytes the allocator has reserved from the driver.
* **CPU** — there is no allocator counter, so a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
  watches every ATen op, counts the bytes of each *fresh* storage an op returns and
  subtracts them when the storage is freed (a weakref finalizer on the storage).

Why not ``torch.distributed._tools.mem_tracker.MemTracker`` on CPU? It counts every storage
an op *returns*, including views of and in-place writes to tensors that existed before the
block: ``weight.t()`` inside ``nn.Linear`` adds the whole weight, ``a.add_(1)`` adds all
of ``a``, and module hooks add parameters and buffers on first use. Its peak is therefore
"bytes touched" rather than "bytes allocated" and can double-count parameters that another
term of the memory model already owns. The tracker here uses each op's schema: a result that
the schema declares as aliasing an input (views, in-place and ``out=`` ops) is not an
allocation. It also skips MemTracker's per-op module bookkeeping, so it is cheaper.

What the CPU tracker cannot see: memory that never becomes a tensor (scratch buffers inside
a kernel, oneDNN workspaces, Python objects), storages created outside the dispatcher
(``torch.from_numpy`` shares numpy's memory and is rightly not counted), and frees of
tensors that already existed at entry (they do not lower the count, so the reported peak is
an upper bound in that case). :func:`process_peak_rss_bytes` is a coarse cross-check for
all of that.

Example:
    >>> with track_peak_memory("cpu") as mem:
    ...     loss = model(x).sum()
    ...     loss.backward()
    >>> print(format_bytes(mem.peak_bytes))
"""

from __future__ import annotations

import re
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from functools import partial
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = [
    "PeakMemory",
    "kept_tensors",
    "track_peak_memory",
    "measure_peak",
    "format_bytes",
    "format_step_memory",
    "parse_bytes",
    "process_peak_rss_bytes",
]

T = TypeVar("T")


class PeakMemory:
    """Result of :func:`track_peak_memory`; read it after (or during) the ``with`` block.

    Attributes:
        device: The device whose memory is measured.
        method: ``"cuda-allocator"`` or ``"cpu-dispatch"``: how the bytes were counted.
    """

    def __init__(self, device: torch.device, method: str) -> None:
        self.device = device
        self.method = method
        self._peak = 0
        self._end: int | None = None
        self._live: Callable[[], tuple[int, int]] | None = None
        self._adopt: Callable[[list[torch.Tensor]], int] | None = None
        self._watch: Callable[[list[list[torch.Tensor]]], Callable[[], list[torch.Tensor]]] | None = None
        self._reset: Callable[[], None] | None = None

    def adopt(self, tensors: Iterable[torch.Tensor]) -> int:
        """Count tensors that existed before the block as live from now on, as if allocated here,
        so that their frees lower the count too; returns the bytes added (their unique storages
        not yet counted). Inside the block only. On CUDA the allocator already counts every
        tensor: nothing is added (returns 0)."""
        if self._adopt is None:
            raise RuntimeError("adopt() works inside the tracked block only")
        return self._adopt([t for t in tensors if isinstance(t, torch.Tensor)])

    def watch(self, groups: Iterable[Iterable[torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
        """Note which groups of existing tensors (e.g. the cache entries of :func:`kept_tensors`)
        the block's ops read from now on; returns a function giving every still-alive tensor of
        each group read so far (to :meth:`adopt` them). On CUDA the allocator counts them anyway:
        the function gives none."""
        if self._watch is None:
            raise RuntimeError("watch() works inside the tracked block only")
        return self._watch([[t for t in g if isinstance(t, torch.Tensor)] for g in groups])

    def reset_peak(self) -> None:
        """Start the peak afresh from the bytes live now (inside the block only)."""
        if self._reset is None:
            raise RuntimeError("reset_peak() works inside the tracked block only")
        self._reset()

    @property
    def peak_bytes(self) -> int:
        """Highest number of tensor bytes live at once during the block, above the baseline at entry.

        Read during the block, it is the peak so far.
        """
        if self._live is not None:
            return self._live()[1]
        return self._peak

    @property
    def end_bytes(self) -> int:
        """Bytes allocated inside the block and still live at its exit (read inside: live now)."""
        if self._live is not None:
            return self._live()[0]
        return self._end if self._end is not None else 0

    def __repr__(self) -> str:
        return (
            f"PeakMemory(device={str(self.device)!r}, method={self.method!r}, "
            f"peak={format_bytes(self.peak_bytes)}, end={format_bytes(self.end_bytes)})"
        )


# ---------------------------------------------------------------------------- CPU


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind ``t``, looking inside traceable wrapper subclasses."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                out.extend(_storages(inner))
        return out
    return [t.untyped_storage()]


# Per overload: for each return, True when its schema says it aliases an input
# (views, in-place and out= variants). Those results are not allocations.
_ALIAS_CACHE: dict[Any, tuple[bool, ...]] = {}
# lift_fresh returns its input, but that input is a tensor just built by torch.tensor().
_FRESH_ALIASES = {torch.ops.aten.lift_fresh.default}


def _aliasing_returns(func: Any) -> tuple[bool, ...]:
    flags = _ALIAS_CACHE.get(func)
    if flags is None:
        if func in _FRESH_ALIASES:
            flags = ()
        else:
            schema = getattr(func, "_schema", None)
            returns = schema.returns if schema is not None else []
            flags = tuple(r.alias_info is not None for r in returns)
        _ALIAS_CACHE[func] = flags
    return flags


class _StorageTracker(TorchDispatchMode):
    """Counts live bytes of storages allocated by ops on one device type while active."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        # id(storage) -> (weakref with finalizer, tracked nbytes). The weakref keeps the
        # finalizer alive; the storage's Python object is preserved by PyTorch as long
        # as any tensor uses it, so the finalizer runs exactly when the memory is freed.
        self._tracked: dict[int, tuple[weakref.ref[Any], int]] = {}
        # Existing tensors being watched for reads (by storage pointer), and those read.
        self._watched: dict[int, int] = {}  # storage pointer -> group
        self._used: dict[int, int] = {}

    def _on_free(self, key: int, _ref: weakref.ref[Any]) -> None:
        entry = self._tracked.get(key)
        if entry is not None and entry[0] is _ref:
            del self._tracked[key]
            self.live -= entry[1]

    def adopt(self, tensors: list[torch.Tensor]) -> int:
        """Track the storages of existing tensors (on this device type) as live."""
        before = self.live
        for t in tensors:
            if t.layout == torch.strided and t.device.type == self.device_type:
                for st in _storages(t):
                    if st.nbytes():
                        self._add(st, True)
        self.peak = max(self.peak, self.live)
        return self.live - before

    def reset_peak(self) -> None:
        self.peak = self.live

    def watch(self, groups: list[list[torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
        """Record which groups of tensors (by storage) ops read from now on."""
        refs = [[weakref.ref(t) for t in g if t.layout == torch.strided] for g in groups]
        for k, g in enumerate(groups):
            for t in g:
                if t.layout == torch.strided and t.device.type == self.device_type and t.untyped_storage().nbytes():
                    self._watched[t.untyped_storage().data_ptr()] = k

        def used() -> list[torch.Tensor]:
            alive = (ref() for k in sorted(set(self._used.values())) for ref in refs[k])
            return [t for t in alive if t is not None]

        return used

    def _note_reads(self, args: Any, kwargs: Any) -> None:
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                ptr = leaf.untyped_storage().data_ptr()
                group = self._watched.pop(ptr, None)
                if group is not None:
                    self._used[ptr] = group

    def _add(self, st: torch.UntypedStorage, fresh: bool) -> None:
        key = id(st)
        entry = self._tracked.get(key)
        if entry is not None and entry[0]() is st:
            self.resized(st)
            return
        if not fresh or st.device.type != self.device_type:
            return
        nbytes = st.nbytes()
        ref = weakref.ref(st, partial(self._on_free, key))
        self._tracked[key] = (ref, nbytes)
        self.live += nbytes

    def resized(self, st: torch.UntypedStorage) -> None:
        """Account for a tracked storage whose size changed (``resize_``, ``out=`` ops)."""
        key = id(st)
        entry = self._tracked.get(key)
        if entry is None or entry[0]() is not st:
            return
        nbytes = st.nbytes()
        if nbytes != entry[1]:
            self._tracked[key] = (entry[0], nbytes)
            self.live += nbytes - entry[1]
            self.peak = max(self.peak, self.live)

    def _add_result(self, res: Any, fresh: bool) -> None:
        if isinstance(res, torch.Tensor):
            if res.layout != torch.strided:
                return
            if type(res) is torch.Tensor or not is_traceable_wrapper_subclass(res):
                self._add(res.untyped_storage(), fresh)
            else:
                for st in _storages(res):
                    self._add(st, fresh)
        elif isinstance(res, (tuple, list)):
            for item in res:
                self._add_result(item, fresh)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self._watched:
            self._note_reads(args, kwargs)
        out = func(*args, **(kwargs or {}))
        aliasing = _ALIAS_CACHE.get(func)
        if aliasing is None:
            aliasing = _aliasing_returns(func)
        if isinstance(out, torch.Tensor):
            self._add_result(out, not (aliasing and aliasing[0]))
        elif isinstance(out, (tuple, list)):
            for i, res in enumerate(out):
                self._add_result(res, not (i < len(aliasing) and aliasing[i]))
        if self.live > self.peak:
            self.peak = self.live
        return out


# UntypedStorage.resize_ does not go through the dispatcher (MemTracker patches it too).
# One patch serves every active tracker; it is installed by the first and removed by the last.
_ACTIVE_CPU: list[_StorageTracker] = []
_ORIG_RESIZE = torch.UntypedStorage.resize_


def _tracked_resize(st: torch.UntypedStorage, size: int) -> Any:
    res = _ORIG_RESIZE(st, size)
    for tracker in _ACTIVE_CPU:
        tracker.resized(st)
    return res


@contextmanager
def _track_cpu(result: PeakMemory) -> Iterator[PeakMemory]:
    tracker = _StorageTracker(result.device.type)
    result._live = lambda: (tracker.live, tracker.peak)
    result._adopt = tracker.adopt
    result._watch = tracker.watch
    result._reset = tracker.reset_peak
    if not _ACTIVE_CPU:
        torch.UntypedStorage.resize_ = _tracked_resize  # type: ignore[method-assign, assignment]
    _ACTIVE_CPU.append(tracker)
    try:
        with tracker:
            yield result
    finally:
        _ACTIVE_CPU.remove(tracker)
        if not _ACTIVE_CPU:
            torch.UntypedStorage.resize_ = _ORIG_RESIZE  # type: ignore[method-assign]
        result._live = result._adopt = result._watch = result._reset = None
        result._peak, result._end = tracker.peak, tracker.live


# --------------------------------------------------------------------------- CUDA

# Trackers open per CUDA device. A nested tracker resets the allocator's peak counter,
# so before it does, every enclosing tracker folds the peak seen so far into its own max.
_ACTIVE_CUDA: dict[int, list[list[int]]] = {}


@contextmanager
def _track_cuda(result: PeakMemory) -> Iterator[PeakMemory]:
    index = result.device.index
    if index is None:
        index = torch.cuda.current_device()
        result.device = torch.device("cuda", index)
    torch.cuda.synchronize(index)
    for outer in _ACTIVE_CUDA.get(index, []):
        outer[0] = max(outer[0], torch.cuda.max_memory_allocated(index))
    baseline = torch.cuda.memory_allocated(index)
    torch.cuda.reset_peak_memory_stats(index)
    max_seen = [baseline]
    stack = _ACTIVE_CUDA.setdefault(index, [])
    stack.append(max_seen)

    def live() -> tuple[int, int]:
        peak = max(max_seen[0], torch.cuda.max_memory_allocated(index))
        return torch.cuda.memory_allocated(index) - baseline, peak - baseline

    def reset() -> None:
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)
        max_seen[0] = torch.cuda.memory_allocated(index)

    result._live = live
    result._adopt = lambda tensors: 0
    result._watch = lambda tensors: list
    result._reset = reset
    try:
        yield result
    finally:
        torch.cuda.synchronize(index)
        stack.remove(max_seen)
        result._end, result._peak = live()
        result._live = result._adopt = result._watch = result._reset = None


def _as_device(device: torch.device | str | int) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def track_peak_memory(
    device: torch.device | str | int = "cpu",
) -> AbstractContextManager[PeakMemory]:
    """Measure the peak tensor memory of a block of code on ``device``.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a :class:`torch.device`, or a CUDA index.
            Only allocations on this device (type) are counted.

    Returns:
        A context manager yielding a :class:`PeakMemory` whose ``peak_bytes`` is the most
        tensor bytes live at once inside the block, above what was live at entry.

    Raises:
        ValueError: A CUDA device was asked for but CUDA is not available.

    Note:
        Trackers nest. On CPU each sees every allocation in its own block. On CUDA the
        allocator has a single peak counter per device; an inner tracker resets it, and
        enclosing trackers keep the peak they had seen before, so their results stay right.
        Concurrent trackers in several threads are not supported on CUDA.
    """
    dev = _as_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"cannot measure memory on {dev}: CUDA is not available in this process; "
                "measure on 'cpu' instead"
            )
        return _track_cuda(PeakMemory(dev, "cuda-allocator"))
    return _track_cpu(PeakMemory(dev, "cpu-dispatch"))


def kept_tensors(*roots: Any, packages: tuple[str, ...] = ("revtrain",), depth: int = 6) -> list[list[torch.Tensor]]:
    """Tensors kept alive between calls, in cache entries: what a library keeps at module level
    (the globals of the loaded modules of ``packages``) or as plain attributes of an ``nn.Module``
    among ``roots`` (not its parameters or buffers, which are registered).

    Returns one list of tensors per **entry**: each value of a module-level dict (a cache keyed
    by shape holds one entry per key), each element of a module-level list or tuple, each
    non-registered attribute of a module. An entry's tensors are used together, so a step that
    reads one of them holds them all.

    The walk descends into dicts, lists, tuples, sets and objects of classes defined in
    ``packages`` (their ``__dict__`` and ``__slots__``), to ``depth`` levels; it does not enter
    other libraries' objects, classes, functions or modules.
    """
    seen: set[int] = set()

    def ours(obj: Any) -> bool:
        return type(obj).__module__.split(".")[0] in packages and not isinstance(obj, type) and not callable(obj)

    def collect(obj: Any, level: int, out: list[torch.Tensor]) -> None:
        if level > depth or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for v in list(obj.values()):
                collect(v, level + 1, out)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in list(obj):
                collect(v, level + 1, out)
        elif ours(obj):
            for v in list(getattr(obj, "__dict__", {}).values()):
                collect(v, level + 1, out)
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    collect(getattr(obj, slot), level + 1, out)

    entries: list[list[torch.Tensor]] = []

    def entry(obj: Any) -> None:
        found: list[torch.Tensor] = []
        collect(obj, 0, found)
        if found:
            entries.append(found)

    for root in roots:
        if isinstance(root, torch.nn.Module):
            for m in root.modules():
                for k, v in vars(m).items():
                    if k not in ("_parameters", "_buffers", "_modules") and not isinstance(v, torch.nn.Module):
                        entry(v)
        else:
            entry(root)
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in packages:
            continue
        for v in list(vars(module).values()):
            if isinstance(v, dict):
                for item in list(v.values()):
                    entry(item)
            elif isinstance(v, (list, tuple, set)):
                for item in list(v):
                    entry(item)
            elif isinstance(v, torch.Tensor) or ours(v):
                entry(v)
    return entries


def measure_peak(fn: Callable[[], T], device: torch.device | str | int = "cpu") -> tuple[T, int]:
    """Call ``fn()`` under :func:`track_peak_memory` and return ``(result, peak_bytes)``.

    Args:
        fn: A callable with no arguments (use ``functools.partial`` or a lambda).
        device: As in :func:`track_peak_memory`.
    """
    with track_peak_memory(device) as mem:
        result = fn()
    return result, mem.peak_bytes


# -------------------------------------------------------------------------- units

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_UNIT_FACTORS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def format_bytes(n: int | float) -> str:
    """Format a byte count with binary units: ``512 B``, ``1.50 KiB``, ``1.23 MiB``."""
    size = float(n)
    if abs(size) < 1024:
        return f"{int(n)} B"
    for unit in _BINARY_UNITS[1:]:
        size /= 1024
        if abs(size) < 1024 or unit == _BINARY_UNITS[-1]:
            break
    return f"{size:.2f} {unit}"


def parse_bytes(value: int | str) -> int:
    """Parse a memory size such as ``"6GiB"``, ``"512 MB"``, ``"1.5kib"`` or ``4096``.

    Units are case-insensitive: ``B``, decimal ``KB``/``MB``/``GB``/``TB`` (powers of 1000) and
    binary ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024). A bare number is bytes. Fractions
    are rounded to the nearest byte.

    Raises:
        ValueError: Negative, empty, or an unknown unit; the message lists the accepted forms.
    """
    accepted = "a byte count such as 4096, '512MB', '1.5GiB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    if isinstance(value, bool):
        raise ValueError(f"expected {accepted}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"memory size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected {accepted}, got {type(value).__name__} {value!r}")
    match = _BYTES_RE.match(value)
    if match is None:
        raise ValueError(f"cannot parse memory size {value!r}: expected {accepted}")
    number, unit = match.groups()
    factor = _UNIT_FACTORS.get(unit.lower() or "b")
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} in memory size {value!r}: expected {accepted}")
    try:
        exact = Decimal(number) * factor
    except InvalidOperation as err:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"cannot parse memory size {value!r}: expected {accepted}") from err
    return int(exact.to_integral_value(rounding=ROUND_HALF_UP))


def format_step_memory(
    batch_size: int, modes: Mapping[str, str], peak_bytes: int, plain_bytes: int | None = None
) -> str:
    """The one way every command prints step memory (a training step's peak tensor bytes, as
    :mod:`revtrain.planner.measure` defines it: parameters, gradients, optimizer state, batch,
    activations), e.g. ``step memory (batch 32, 14 M / 11 C of 25 reversible blocks): 129.13
    MiB; plain backprop needs 281.14 MiB (2.18x)``.

    Args:
        batch_size: The batch size measured.
        modes: Each reversible block's mode, by name (empty for a model without any).
        peak_bytes: The step memory in these modes.
        plain_bytes: The step memory with every block in C-mode (plain backprop), if measured.
    """
    if modes:
        c = sum(m == "C" for m in modes.values())
        blocks = f"{len(modes) - c} M / {c} C of {len(modes)} reversible blocks"
    else:
        blocks = "no reversible blocks"
    line = f"step memory (batch {batch_size}, {blocks}): {format_bytes(peak_bytes)}"
    if plain_bytes is not None:
        ratio = f" ({plain_bytes / peak_bytes:.2f}x)" if peak_bytes else ""
        line += f"; plain backprop needs {format_bytes(plain_bytes)}{ratio}"
    return line


def process_peak_rss_bytes() -> int | None:
    """Peak resident set size of this process so far, in bytes; ``None`` where unsupported.

    A coarse cross-check only: it includes the Python interpreter, libraries and allocator
    caches, and never goes down, so compare it between fresh processes.
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
