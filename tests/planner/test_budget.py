"""Reading a budget: bytes, units, fractions of the device's memory, the default, and bad input."""

from __future__ import annotations

import pytest

import revtrain.planner.budget as budget_mod
from revtrain.planner import available_memory_bytes, resolve_budget

GiB = 2**30
RAM = 8 * GiB  # the available RAM the fraction tests pretend to have


@pytest.fixture
def fixed_ram(monkeypatch):
    """Available RAM pinned to 8 GiB: the real figure changes between two reads."""
    monkeypatch.setattr(budget_mod, "available_memory_bytes", lambda device=None: (RAM, "test RAM"))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(4096, 4096), ("4096", 4096), ("6GiB", 6 * GiB), ("512 MB", 512 * 10**6), ("1.5kib", 1536), (0, 0)],
)
def test_bytes_and_units(spec, expected, fixed_ram):
    got, why = resolve_budget(spec, "cpu")
    assert got == expected
    assert "as given" in why and str(expected) in why


@pytest.mark.parametrize(
    ("spec", "fraction"), [("0.5", 0.5), ("50%", 0.5), (" 25 % ", 0.25), ("1.0", 1.0), ("100%", 1.0), (".1", 0.1)]
)
def test_fractions_are_of_available_ram_on_cpu(spec, fraction, fixed_ram):
    got, why = resolve_budget(spec, "cpu")
    assert got == int(RAM * fraction)
    assert f"{fraction * 100:g}%" in why and "test RAM" in why


def test_no_budget_takes_available_ram_and_says_so(fixed_ram):
    got, why = resolve_budget(None, "cpu")
    assert got == RAM
    assert why.startswith("no budget given") and "test RAM" in why


def test_budget_beyond_the_device_is_noted(fixed_ram):
    _, why = resolve_budget("1TiB", "cpu")
    assert "note: more than" in why


def test_available_ram_is_read_from_the_system():
    got, where = available_memory_bytes("cpu")
    assert got > 0
    assert "available RAM" in where


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (-1, "negative"),
        ("-1", "cannot parse"),
        ("1.5", "fraction"),
        ("0.0", "fraction"),
        ("150%", "percentage"),
        ("0%", "percentage"),
        ("6 XB", "unknown unit"),
        ("lots", "cannot parse"),
        ("", "cannot parse"),
        (True, "got bool"),
        (2.5, "got float"),
    ],
)
def test_bad_budgets_name_the_problem_and_the_accepted_forms(spec, words, fixed_ram):
    with pytest.raises(ValueError) as info:
        resolve_budget(spec, "cpu")
    msg = str(info.value)
    assert words in msg
    assert "'6GiB'" in msg and "'50%'" in msg


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(budget_mod.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_budget("50%", "cuda")
