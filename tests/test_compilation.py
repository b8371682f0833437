"""torch.compile of F/G and the non-reversible parts: same gradients, same state, copies work.

These tests compile small graphs with inductor (a C++ compiler is on every machine revtrain's
CI runs on); one model is compiled once for the module, ~15 s on 2 cores.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from revtrain import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.compilation import compile_model, uncompile_model
from revtrain.layers import InPlaceABN


def _fn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2), nn.Tanh())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 1),
        ReversibleSequence([ReversibleBlock(_fn(), _fn()) for _ in range(2)]),
        nn.Conv2d(4, 4, 1), InPlaceABN(4),
        nn.Flatten(), nn.Linear(4 * 5 * 5, 3),
    ).double()


@pytest.fixture(scope="module")
def compiled() -> nn.Module:
    model = _model()
    compile_model(model)
    return model


def test_compile_picks_f_g_and_the_reversible_free_parts_only():
    model = _model()
    names = compile_model(model)
    assert names == ["0", "1.blocks.0.f", "1.blocks.0.g", "1.blocks.1.f", "1.blocks.1.g", "2", "5"]
    assert compile_model(model) == []  # idempotent
    assert list(model.state_dict()) == list(_model().state_dict())  # checkpoints unchanged
    assert uncompile_model(model) == len(names)
    assert all(not hasattr(m, "_revtrain_compiled") for m in model.modules())


def test_compiled_gradients_equal_eager_in_both_modes(compiled):
    x = torch.randn(3, 1, 5, 5, dtype=torch.float64)
    y = torch.tensor([0, 2, 1])
    eager = _model()
    for mode in ("M", "C"):
        for model in (eager, compiled):
            set_modes(model, mode)
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=f"{mode}: {name}")
        for (name, b), c in zip(eager.named_buffers(), compiled.buffers()):
            torch.testing.assert_close(c, b, rtol=1e-9, atol=1e-12, msg=f"{mode}: {name}")


def test_a_deep_copy_of_a_compiled_model_trains_its_own_parameters(compiled):
    compiled.zero_grad(set_to_none=True)
    replica = copy.deepcopy(compiled)
    replica(torch.randn(3, 1, 5, 5, dtype=torch.float64)).sum().backward()
    assert all(p.grad is None for p in compiled.parameters())
    assert all(p.grad is not None for p in replica.parameters())


def test_eager_training_leaves_dynamo_unimported():
    """Importing revtrain and training in M-mode never load Dynamo (it slows every process's
    start): the core's "not traced by torch.compile" mark waits for torch.compile."""
    code = ("import sys, torch, revtrain, revtrain.cli\n"
            "from revtrain.models import create_model\n"
            "model = create_model('revnet38', in_channels=1, num_classes=10)\n"
            "model(torch.randn(2, 1, 8, 8)).sum().backward()\n"
            "assert all(p.grad is not None for p in model.parameters())\n"
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


def test_torch_compile_of_a_zoo_model_in_a_users_loop_matches_eager_without_recompile_warnings(monkeypatch):
    """``torch.compile(model)`` as a user writes it, on the zoo's RevNet-38 in M-mode: a short
    training loop recompiles nothing past dynamo's limit (M-mode runs are graph breaks that run
    eagerly) and its gradients equal eager mode's, step after step, in float64."""
    import logging
    import warnings

    from revtrain.models import create_model

    import revtrain.core.function

    # As in a fresh process: the first M-mode run of the session is the compiled model's.
    monkeypatch.setattr(revtrain.core.function, "_DISABLED", {})
    torch.manual_seed(0)
    model = create_model("revnet38", in_channels=1, num_classes=10).double()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (4,))
                for m, opt in zip((compiled, eager), optimizers):
                    opt.zero_grad()
                    nn.functional.cross_entropy(m(x), y).backward()
                for (name, p), q in zip(eager.named_parameters(), model.parameters()):
                    torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
                for opt in optimizers:
                    opt.step()
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    said = [r.getMessage() for r in records] + [str(w.message) for w in caught]
    assert not [m for m in said if "recompile" in m.lower() or "cache_size_limit" in m], said
