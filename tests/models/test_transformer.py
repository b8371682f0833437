"""Reversible Transformers (language models and ViTs): exact gradients, causality, dropout replay.

For every registered reversible Transformer small enough to run in float64 here: M-mode
(rebuild in backward) equals C-mode (plain autograd of the same weights) for the output, the
gradient of the input embedding and every parameter gradient; and C-mode equals the coupling
equations written out by hand on the same weights. The attention itself is checked against
an explicit masked softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from revtrain.core import ReversibleSequence, reversible_blocks, set_modes
from revtrain.models import (
    RevTransformerLM,
    TransformerConfig,
    TransformerLM,
    count_params,
    create_model,
    example_batch,
    list_models,
    model_info,
)
from revtrain.models.transformer_layers import SelfAttention, SequenceTooLongError

# float64: the modes differ only by rounding in the rebuilt inputs (measured worst case ~1e-15
# of the largest entry); 1e-10 leaves room for that and catches any missing or doubled term.
RTOL = 1e-10
ATOL_OF_SCALE = 1e-12

TRANSFORMERS = [n for n in list_models() if model_info(n).builder.__module__ in (
    "revtrain.models.transformer", "revtrain.models.vit")]
REVERSIBLE = [n for n in TRANSFORMERS if model_info(n).reversible]
TWINS = {"revformer_tiny": "transformer_tiny", "revformer_small": "transformer_small",
         "revformer_enwik8": "transformer_enwik8", "revvit_digits": "vit_digits", "revvit_cifar": "vit_cifar"}
# Run in float64 here: everything under 2M parameters (the 40M-parameter enwik8 shape is
# checked on the meta device and by its parameter count).
SMALL = [n for n in REVERSIBLE if count_params(n) < 2_000_000]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(name: str, batch: int = 2, length: int = 12) -> torch.Tensor:
    info = model_info(name)
    if info.inputs.kind == "tokens":
        x, _ = example_batch(name, batch, seed=1, input_size=(min(length, info.input_size[0]),))
        return x
    return example_batch(name, batch, seed=1)[0].double()


def _run(model, x, mode):
    """Output, gradient of the embedding's output, and every parameter gradient."""
    set_modes(model, mode)
    model.zero_grad(set_to_none=True)
    captured = {}

    def keep(_module, _inp, out):
        out.retain_grad()
        captured["h"] = out

    handle = model.embed.register_forward_hook(keep)
    try:
        out = model(x)
    finally:
        handle.remove()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), captured["h"].grad.clone(), grads


def _assert_same(got, want, what):
    scale = max(t.abs().max().item() for t in want.values())
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL_OF_SCALE * scale,
                                   msg=lambda m, key=key: f"{what} {key}: {m}")


def _assert_runs_equal(a, b, what):
    (out_a, dh_a, g_a), (out_b, dh_b, g_b) = a, b
    _assert_same({"output": out_a}, {"output": out_b}, what)
    _assert_same({"embedding gradient": dh_a}, {"embedding gradient": dh_b}, what)
    assert g_a.keys() == g_b.keys()
    _assert_same(g_a, g_b, what + " gradient of")


def _reference(model, x):
    """The coupling equations by hand: y1 = x1 + F(x2), y2 = x2 + G(y1), streams averaged."""
    h = model.embed(x)
    x1 = x2 = h
    for block in model.layers:
        x1 = x1 + block.f(x2)
        x2 = x2 + block.g(x1)
    return model.head(0.5 * (x1 + x2))


class _Reference(torch.nn.Module):
    """Wraps a reversible model so that ``_run`` calls the hand-written equations."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.embed = model.embed

    def forward(self, x):
        return _reference(self.model, x)


@pytest.mark.parametrize("name", SMALL)
def test_m_mode_equals_c_mode_equals_the_coupling_equations(name):
    torch.manual_seed(0)
    model = create_model(name).double().train()
    x = _inputs(name)
    c_run = _run(model, x, "C")
    m_run = _run(model, x, "M")
    _assert_runs_equal(m_run, c_run, "M vs C")
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in c_run[2].values())
    ref = _Reference(model)
    ref_run = _run(ref, x, "C")
    ref_grads = {k.removeprefix("model."): v for k, v in ref_run[2].items()}
    _assert_runs_equal(c_run, (ref_run[0], ref_run[1], ref_grads), "C vs hand-written")


@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("options", [dict(dropout=0.2), dict(ff_chunks=3, tie_embeddings=True)])
def test_options_keep_m_mode_exact(positions, options):
    """Dropout replays exactly (same seed, both modes); chunking and tying change nothing either."""
    torch.manual_seed(0)
    model = create_model("revformer_tiny", positions=positions, **options).double().train()
    x = _inputs("revformer_tiny", length=16)
    torch.manual_seed(7)
    c_run = _run(model, x, "C")
    torch.manual_seed(7)
    m_run = _run(model, x, "M")
    _assert_runs_equal(m_run, c_run, "M vs C")
    if options.get("dropout"):
        # The test can fail: with another seed the dropout masks, hence the outputs, differ.
        torch.manual_seed(8)
        assert not torch.allclose(_run(model, x, "C")[0], c_run[0])
        torch.manual_seed(7)
        _assert_same({"o": _run(model.eval(), x, "M")[0]}, {"o": _run(model, x, "C")[0]}, "eval")


def test_feed_forward_chunking_computes_the_same_function():
    torch.manual_seed(0)
    whole = create_model("revformer_tiny").double()
    chunked = create_model("revformer_tiny", ff_chunks=5).double()
    chunked.load_state_dict(whole.state_dict())
    x = _inputs("revformer_tiny", length=16)
    _assert_runs_equal(_run(chunked, x, "M"), _run(whole, x, "M"), "chunked vs whole")


@pytest.mark.parametrize("name", ["revformer_tiny", "transformer_tiny"])
@pytest.mark.parametrize("mode", ["M", "C"])
def test_changing_token_t_never_changes_outputs_before_t(name, mode):
    torch.manual_seed(0)
    model = create_model(name, positions="rotary").double().train()
    set_modes(model, mode)
    x = _inputs(name, batch=2, length=16)
    base = model(x)
    for t in (0, 5, 15):
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 101) % 256
        out = model(changed)
        # Masked scores are exactly zero after the softmax, so earlier positions are bitwise equal.
        assert torch.equal(out[:, :t], base[:, :t]), f"position < {t} saw token {t}"
        assert not torch.allclose(out[:, t], base[:, t])
    # And no gradient flows from an output back to a later position's embedding.
    captured = {}

    def keep(_module, _inp, out):
        out.retain_grad()
        captured["h"] = out

    handle = model.embed.register_forward_hook(keep)
    model(x)[:, 6].sum().backward()
    handle.remove()
    dh = captured["h"].grad
    assert dh[:, 7:].abs().max() == 0 and dh[:, :7].abs().max() > 0


def _manual_attention(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Multi-head attention by hand: explicit scores, mask, softmax; rotary as 2x2 rotations."""
    b, t, d = x.shape
    h = attn.heads
    q, k, v = (attn.qkv(attn.norm(x)).view(b, t, 3, h, d // h)).unbind(2)  # (B, T, H, d/H)
    if attn.rotary:
        half = d // h // 2
        angle = torch.arange(t, dtype=x.dtype)[:, None] * attn.inv_freq[None, :half].to(x.dtype)  # (T, half)
        cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]

        def rotate(z):
            a, c = z[..., :half], z[..., half:]  # feature i is paired with i + half
            return torch.cat([a * cos - c * sin, a * sin + c * cos], dim=-1)

        q, k = rotate(q), rotate(k)
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(d // h)
    if attn.causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhe->bqhe", scores.softmax(-1), v).reshape(b, t, d)
    return attn.proj(out)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [True, False])
def test_attention_is_multi_head_softmax_attention(causal, rotary):
    torch.manual_seed(0)
    attn = SelfAttention(12, 3, causal=causal, rotary=rotary).double().eval()
    for p in attn.parameters():  # non-trivial LayerNorm and biases too
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _manual_attention(attn, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rev, plain", sorted(TWINS.items()))
def test_twins_have_the_same_parameter_count(rev, plain):
    assert model_info(rev).reversible and not model_info(plain).reversible
    assert model_info(rev).inputs == model_info(plain).inputs
    assert count_params(rev) == count_params(plain)


def test_parameter_count_follows_the_architecture():
    v, t, d, depth = 256, 128, 64, 4
    per_layer = (2 * d + 3 * d * d + 3 * d + d * d + d) + (2 * d + 4 * d * d + 4 * d + 4 * d * d + d)
    expected = v * d + t * d + depth * per_layer + 2 * d + v * d
    assert count_params("revformer_small") == expected == count_params("transformer_small")
    assert count_params("revformer_small", tie_embeddings=True) == expected - v * d
    assert count_params("revformer_small", positions="rotary") == expected - t * d
    # The paper's shape (12 layers, 8 heads, 4096 tokens, width 512): 40.19M.
    assert count_params("revformer_enwik8") == 40_188_928


def test_registered_shapes_and_structure():
    """Each reversible Transformer holds all its blocks in one sequence; names read as documented."""
    for name in REVERSIBLE:
        with torch.device("meta"):
            model = create_model(name)
        blocks = reversible_blocks(model)
        assert isinstance(model.layers, ReversibleSequence) and len(model.layers) == len(blocks)
        assert [n for n, _ in blocks] == [f"layers.blocks.{i}" for i in range(len(blocks))]
        x, _ = example_batch(name, 2, "meta")
        out = model(x)
        spec = model_info(name).inputs
        assert out.shape == ((2, *spec.shape, spec.num_classes) if spec.kind == "tokens" else (2, spec.num_classes))
    assert len(reversible_blocks(create_model("revformer_small"))) == 4
    with torch.device("meta"):
        assert len(reversible_blocks(create_model("revformer_enwik8"))) == 12


def test_dashes_name_the_same_model():
    assert model_info("revformer-small") is model_info("revformer_small")
    assert isinstance(create_model("transformer-tiny"), TransformerLM)


def test_plain_twin_is_ordinary_residuals_on_the_same_modules():
    torch.manual_seed(0)
    plain = create_model("transformer_tiny").double()
    x = _inputs("transformer_tiny")
    h = plain.embed(x)
    for layer in plain.layers:
        h = h + layer.attn(h)
        h = h + layer.ff(h)
    torch.testing.assert_close(plain(x), plain.head(h), rtol=0, atol=0)


# ----------------------------------------------------------------------------- bad input


def test_a_sequence_longer_than_the_context_is_refused():
    for cls in (RevTransformerLM, TransformerLM):
        model = cls(TransformerConfig(context=8, width=8, depth=1, heads=2))
        with pytest.raises(SequenceTooLongError, match="9 tokens is longer than the model's context of 8"):
            model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.zeros(2, 4), "integer token ids"),
        (torch.zeros(8, dtype=torch.long), r"shape \(batch, sequence\)"),
        (torch.full((1, 4), 256), r"token ids must lie in \[0, 256\)"),
        (torch.full((1, 4), -1), r"token ids must lie in \[0, 256\)"),
    ],
)
def test_bad_token_ids_are_refused(ids, message):
    with pytest.raises(ValueError, match=message):
        create_model("revformer_tiny")(ids)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(width=30, heads=4), "heads=4 does not divide width=30"),
        (dict(width=6, heads=2, positions="rotary"), "head width must be even"),
        (dict(width=0, heads=1), "must be positive"),
        (dict(context=0), "context must be a positive integer"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(positions="sinusoidal"), "'learned' or 'rotary'"),
        (dict(ff_chunks=0), "ff_chunks"),
    ],
)
def test_bad_configs_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**kwargs)


def test_registered_models_refuse_shape_overrides_and_images_of_the_wrong_shape():
    with pytest.raises(TypeError, match="width, depth and heads are fixed"):
        create_model("revformer_tiny", width=32)
    with pytest.raises(ValueError, match="does not divide image_size"):
        create_model("revvit_digits", image_size=9)
    vit = create_model("revvit_digits")
    with pytest.raises(ValueError, match=r"takes images of shape \(batch, 1, 8, 8\)"):
        vit(torch.zeros(2, 3, 8, 8))
    wide = create_model("vit_cifar", in_channels=1, num_classes=5, image_size=16)
    assert wide(torch.zeros(2, 1, 16, 16)).shape == (2, 5)


def test_context_override_changes_only_the_position_table():
    small = create_model("revformer_tiny", context=64)
    assert small.context == 64 and small(torch.zeros(1, 64, dtype=torch.long)).shape == (1, 64, 256)
    assert count_params("revformer_tiny", context=64) - count_params("revformer_tiny") == 48 * 16


def test_twins_built_from_the_same_seed_start_from_the_same_weights():
    torch.manual_seed(3)
    rev = create_model("revformer_tiny")
    torch.manual_seed(3)
    plain = create_model("transformer_tiny")
    pairs = list(zip(rev.parameters(), plain.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
