"""Peak-memory measurement: exact byte counts on CPU, allocator counters on CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from revtrain.memory import (
    PeakMemory,
    format_bytes,
    measure_peak,
    parse_bytes,
    process_peak_rss_bytes,
    track_peak_memory,
)

MB4 = 1000 * 1000 * 4  # bytes of a float32 (1000, 1000) tensor


def test_a_known_allocation_is_counted_exactly():
    with track_peak_memory("cpu") as mem:
        t = torch.empty(1000, 1000)
    assert isinstance(mem, PeakMemory) and mem.method == "cpu-dispatch"
    assert mem.peak_bytes == MB4 and mem.end_bytes == MB4
    del t


def test_alloc_free_alloc_peaks_at_the_max_not_the_sum():
    with track_peak_memory() as mem:
        a = torch.ones(1000, 1000)
        del a
        b = torch.ones(500, 1000)
        c = torch.ones(1000, 1000)
        del b, c
    assert mem.peak_bytes == MB4 + MB4 // 2
    assert mem.end_bytes == 0


def test_peak_is_readable_inside_the_block():
    with track_peak_memory() as mem:
        t = torch.zeros(250, 1000)
        assert mem.peak_bytes == MB4 // 4
        del t
        assert mem.end_bytes == 0
    assert mem.peak_bytes == MB4 // 4


def test_views_and_in_place_writes_to_existing_tensors_are_not_allocations():
    existing = torch.zeros(1000, 1000)
    weight = nn.Linear(1000, 1000).weight
    with track_peak_memory() as mem:
        existing.add_(1)
        v = existing.t()[:10]
        w = weight.detach().view(-1)
    assert mem.peak_bytes == 0
    del v, w


def test_tensors_from_python_data_are_counted():
    with track_peak_memory() as mem:
        t = torch.tensor([1.0] * 1000)
    assert mem.peak_bytes == 4000
    del t


def test_freeing_storage_by_resize_is_seen():
    with track_peak_memory() as mem:
        a = torch.empty(1000, 1000)
        a.untyped_storage().resize_(0)
        b = torch.empty(1000, 1000)
    assert mem.peak_bytes == MB4
    del a, b


def test_nested_trackers_each_see_their_block():
    with track_peak_memory() as outer:
        a = torch.empty(1000, 1000)
        with track_peak_memory() as inner:
            b = torch.empty(250, 1000)
        del a, b
    assert inner.peak_bytes == MB4 // 4
    assert outer.peak_bytes == MB4 + MB4 // 4


def test_mlp_forward_backward_peak_is_plausible():
    torch.manual_seed(0)
    batch, d_in, hidden, d_out = 64, 256, 1024, 10
    net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    x = torch.randn(batch, d_in)
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    hidden_bytes = batch * hidden * 4
    with track_peak_memory() as mem:
        loss = net(x).square().mean()
        after_forward, forward_peak = mem.end_bytes, mem.peak_bytes
        loss.backward()
    # Saved for backward: the ReLU output (also Linear-2's input) and the logits.
    saved = hidden_bytes + batch * d_out * 4
    assert after_forward >= saved
    assert forward_peak >= 2 * hidden_bytes  # ReLU's input and output coexist
    # All gradients are live at the end, and while the first layer's weight gradient is made,
    # the hidden gradient is live too (its bias gradient may come later).
    assert mem.end_bytes >= param_bytes
    assert mem.peak_bytes >= param_bytes - hidden * 4 + hidden_bytes
    # Parameters were made outside the block: counting them (as MemTracker does when a
    # module touches them) would put the peak above parameters + gradients.
    assert mem.peak_bytes < 2 * param_bytes


def test_measure_peak_returns_result_and_bytes():
    result, peak = measure_peak(lambda: torch.ones(10, 10) * 2)
    assert torch.equal(result, torch.full((10, 10), 2.0))
    assert peak == 800  # ones and the product live at once


def test_cpu_tracker_ignores_other_devices():
    with track_peak_memory("cpu") as mem:
        torch.empty(10, device="meta")
    assert mem.peak_bytes == 0


def test_cuda_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="CUDA is not available"):
        track_peak_memory("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocation_and_nesting():
    keep = torch.empty(1024, 1024, device="cuda")  # baseline, not counted
    with track_peak_memory("cuda") as outer:
        a = torch.empty(1024, 1024, device="cuda")
        del a
        with track_peak_memory("cuda") as inner:
            b = torch.empty(256, 1024, device="cuda")
            del b
    assert outer.method == "cuda-allocator"
    assert outer.peak_bytes == 4 * 1024 * 1024  # the inner reset must not hide the earlier peak
    assert inner.peak_bytes == 1024 * 1024
    assert outer.end_bytes == 0
    del keep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cpu_agree_on_an_mlp_step():
    def step(device: str) -> int:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).to(device)
        x = torch.randn(256, 512, device=device)
        net(x).square().mean().backward()  # warm-up: cuBLAS workspaces are allocated once
        net.zero_grad(set_to_none=True)
        with track_peak_memory(device) as mem:
            net(x).square().mean().backward()
        return mem.peak_bytes

    cpu, cuda = step("cpu"), step("cuda")
    # Same ops, same tensors; CUDA adds 512-byte rounding per block and small reduction scratch.
    assert cpu <= cuda <= 1.05 * cpu + 2**20


# ------------------------------------------------------------------------ units


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GiB", 6 * 2**30),
        ("6gib", 6 * 2**30),
        ("512 MB", 512_000_000),
        ("1.5KiB", 1536),
        ("1kb", 1000),
        ("4096", 4096),
        ("10b", 10),
        (" 2 TiB ", 2 * 2**40),
        (123, 123),
        ("0.5KiB", 512),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "6 gigs", "-1GB", "1e3", "6 G", "1.2.3MB", True, -5, 1.5])
def test_parse_bytes_rejects_with_a_helpful_message(bad):
    with pytest.raises(ValueError, match=r"expected a byte count|must not be negative"):
        parse_bytes(bad)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.50 KiB"),
        (int(1.23 * 2**20), "1.23 MiB"),
        (3 * 2**30, "3.00 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("n", [2**20, 3 * 2**30, 5 * 2**40])
def test_format_parse_round_trip(n):
    assert parse_bytes(format_bytes(n).replace(" ", "")) == n


def test_process_peak_rss_is_a_plausible_number():
    rss = process_peak_rss_bytes()
    if rss is None:
        pytest.skip("no resource module on this platform")
    assert 10 * 2**20 < rss < 2**40  # the interpreter with torch loaded


def test_adopted_tensors_count_as_live_and_their_frees_are_seen():
    kept = [torch.empty(1000, 1000)]
    with track_peak_memory("cpu") as mem:
        assert mem.adopt([kept[0], kept[0].view(-1)]) == MB4  # one storage, counted once
        kept.clear()  # freed inside the block: the count drops
        assert mem.end_bytes == 0
        b = torch.empty(500, 1000)
        mem.reset_peak()
        assert mem.peak_bytes == MB4 // 2
        del b
    assert mem.peak_bytes == MB4 // 2 and mem.end_bytes == 0


def test_kept_tensors_finds_caches_at_module_level_and_on_modules_not_parameters():
    import types

    from revtrain.memory import kept_tensors

    lib = types.ModuleType("revtrain._cache_for_test")
    lib.cache = {("k", 1): [torch.ones(3), torch.ones(2)]}
    sys.modules[lib.__name__] = lib
    try:
        layer = nn.Linear(2, 2)
        layer.mask = torch.zeros(5)  # a plain attribute, kept between calls
        entries = kept_tensors(layer)
        found = {id(t) for entry in entries for t in entry}
        assert id(lib.cache[("k", 1)][0]) in found and id(layer.mask) in found
        assert id(layer.weight) not in found and id(layer.bias) not in found
        assert [id(t) for t in lib.cache[("k", 1)]] in [[id(t) for t in e] for e in entries]  # one entry
    finally:
        del sys.modules[lib.__name__]
