"""The planner on every kind of reversible layer: coupling blocks (RevNet, Transformer) and
invertible layers (In-place ABN, any ``Invertible``), and the sample shape in the workload key."""

from __future__ import annotations

import copy
import json
from collections import Counter
from functools import partial

import pytest
import torch
from torch import nn

from revtrain.core import Invertible, ReversibleBlock, get_modes, reversible_blocks, set_modes, set_rebuild_checks
from revtrain.layers import InPlaceABN
from revtrain.models import create_model_for, input_spec
from revtrain.models.resnext import ResNeXt
from revtrain.planner import Plan, Profile, TimingRule, make_plan, plan_for_model, prepare, profile_model, run_pipeline
from revtrain.planner.block_timing import time_blocks
from revtrain.tasks import task_for

ONE_PAIR = TimingRule(warmup_pairs=0, min_pairs=1, max_pairs=1)


class CountingScale(Invertible):
    """``y = x * exp(s)`` per channel, counting its forward and inverse calls and the shapes it sees."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.log_s = nn.Parameter(torch.full((channels, 1, 1), 0.1))
        self.calls: Counter[str] = Counter()
        self.shapes: set[tuple[int, ...]] = set()

    def forward_state(self, xs):
        (x,) = xs
        self.calls["forward"] += 1
        self.shapes.add(tuple(x.shape))
        return (x * self.log_s.exp(),)

    def inverse_state(self, ys):
        (y,) = ys
        self.calls["inverse"] += 1
        return (y * (-self.log_s).exp(),)


def _half_conv() -> nn.Module:
    return nn.Sequential(nn.BatchNorm2d(2), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1, bias=False))


def mixed_model() -> nn.Sequential:
    """One reversible layer of each kind: a one-tensor Invertible, In-place ABN, a coupling block
    called on one tensor (split in halves inside), between ordinary layers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        CountingScale(4),
        InPlaceABN(4),
        ReversibleBlock(_half_conv(), _half_conv()),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10),
    )


def image_batch(b: int = 4, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(b, 3, size, size, generator=gen), torch.randint(0, 10, (b,), generator=gen)


def test_every_kind_of_layer_is_timed_in_both_modes_on_the_arguments_the_model_gave_it():
    model = mixed_model()
    scale = model[1]
    pairs = 3
    rule = TimingRule(warmup_pairs=0, min_pairs=pairs, max_pairs=pairs)
    with prepare(model, image_batch()) as setup:
        timing = time_blocks(setup, rule)
    assert list(timing) == [name for name, _ in reversible_blocks(model)] == ["1", "2", "3"]
    assert all(t.pairs == pairs for t in timing.values())
    # The model's own no-grad forward: 1 call. Each C run: 1 forward. Each M run: 1 forward, then
    # in backward 1 inverse and 1 forward that builds the graph to differentiate. So both modes ran,
    # with a backward, on this layer alone.
    assert scale.calls == {"forward": 1 + pairs * (1 + 2), "inverse": pairs}
    assert scale.shapes == {(4, 4, 6, 6)}  # the model's activation, not a guess


def test_in_place_abn_layers_are_planned_within_a_budget_that_forces_a_mix():
    spec = input_spec("resnext29_iabn", input_size=(3, 8, 8))
    model = create_model_for("resnext29_iabn", spec)
    # The rebuild check keeps projections between steps, and step memory counts them: at this toy
    # size they make baseline-M's step as large as baseline-C's, and no budget could force a mix.
    set_rebuild_checks(model, 0)
    batch = spec.example(2)
    profile = profile_model(model, batch, repeats=1, warmup=1, timing=ONE_PAIR, model_name="resnext29_iabn")
    layers = reversible_blocks(model)
    assert {type(layer) for _, layer in layers} == {InPlaceABN}
    assert [b.name for b in profile.blocks] == [name for name, _ in layers]
    assert all(b.m_bytes > 0 and b.t_e_s > 0 for b in profile.blocks)
    # Halfway between the measured peaks of baseline-M and baseline-C: all-C does not fit, all-M
    # leaves room, so the knapsack must mix.
    assert profile.peak_C_bytes is not None and profile.peak_C_bytes > profile.m_o_bytes
    budget = (profile.m_o_bytes + profile.peak_C_bytes) // 2
    plan = plan_for_model(model, batch, budget, profile=profile, refine=0, measure=True, repeats=1, warmup=1)
    assert set(plan.modes.values()) == {"M", "C"}
    assert plan.input_shape == (3, 8, 8) and plan.batch_size == 2
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    plan.apply(model)
    assert get_modes(model) == plan.modes


def test_transformer_blocks_are_planned_with_the_language_modelling_loss():
    spec = input_spec("revformer_tiny", input_size=(8,))
    model = create_model_for("revformer_tiny", spec)
    assert model.embed.context == 8  # built for the sequence length
    plan = plan_for_model(model, spec.example(2), "1GiB", loss_fn=task_for(spec).loss, repeats=1, warmup=1,
                          refine=0, timing=ONE_PAIR, measure=True)
    assert list(plan.modes) == [name for name, _ in reversible_blocks(model)]
    assert {type(layer) for _, layer in reversible_blocks(model)} == {ReversibleBlock}
    assert plan.input_shape == (8,)  # the sequence length is part of the plan's workload
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes


def test_a_saved_profile_of_another_sequence_length_is_refused(tmp_path):
    spec = input_spec("revformer_tiny", input_size=(8,))
    loss = task_for(spec).loss
    model = create_model_for("revformer_tiny", spec.with_changes(shape=(16,)))  # context 16 takes both
    profile = profile_model(model, spec.example(2), loss_fn=loss, repeats=1, warmup=1, timing=ONE_PAIR)
    assert profile.input_shape == (8,)
    profile.to_json(tmp_path / "profile.json")
    saved = Profile.from_json(tmp_path / "profile.json")
    longer = spec.with_changes(shape=(16,)).example(2)
    with prepare(model, longer, loss_fn=loss, repeats=1, warmup=1) as setup:
        with pytest.raises(ValueError, match=r"at batch size 2, sequence length 8; this run has 2 reversible "
                                             r"blocks at batch size 2, sequence length 16\. .* profile this model"):
            run_pipeline(setup, "1GiB", verify=False, profile=saved)
    # The same saved profile is taken at its own sequence length.
    with prepare(model, spec.example(2), loss_fn=loss, repeats=1, warmup=1) as setup:
        assert run_pipeline(setup, "1GiB", verify=False, profile=saved).profile is saved


def tiny_resnext_iabn(num_classes: int = 10) -> ResNeXt:
    """resnext29_iabn's layout at test size: two stages of one unit, cardinality 2."""
    return ResNeXt((1, 1), cardinality=2, group_width=2, stem="cifar", norm_act=partial(InPlaceABN, slope=0.01),
                   num_classes=num_classes)


def _transformer_case():
    spec = input_spec("revformer_tiny", input_size=(8,))
    torch.manual_seed(0)
    # Dropout on: M-mode must replay each block's dropout masks exactly when it rebuilds and
    # re-runs the block in backward.
    return create_model_for("revformer_tiny", spec, dropout=0.1).double(), spec.example(3), task_for(spec).loss


def _in_place_abn_case():
    # 16x16 images: at 8x8 the step's peak hides what C-mode keeps (baseline-C peaks only 3 KiB
    # above baseline-M, less than the smallest layer's m_i), so no budget could force a mix.
    spec = input_spec("resnext29_iabn", input_size=(3, 16, 16)).with_changes(dtype=torch.float64)
    torch.manual_seed(0)
    model = tiny_resnext_iabn().double()
    set_rebuild_checks(model, 0)  # its cached projections would make M-mode's step as large as C-mode's
    return model, spec.example(3), task_for(spec).loss


@pytest.mark.parametrize("case", [_transformer_case, _in_place_abn_case], ids=["transformer", "in-place-abn"])
def test_the_planned_model_trains_exactly_like_all_c_mode(case):
    # Profile -> plan -> apply, with a budget that forces a mix of modes, then one training
    # step of the planned model and of its all-C-mode copy: in float64 the losses, every
    # parameter gradient and every running statistic agree to round-off.
    model, (x, y), loss_fn = case()
    profile = profile_model(model, (x, y), loss_fn=loss_fn, repeats=1, warmup=1, timing=ONE_PAIR)
    # Room for some C-mode blocks but not for all: below both the additive model's and the
    # measured baseline-C peak (in a model this small, fixed bytes hide most of Σm_i).
    budget = min(profile.m_o_bytes + max(b.m_bytes for b in profile.blocks), profile.peak_C_bytes - 1)
    plan = plan_for_model(model, (x, y), budget, loss_fn=loss_fn, profile=profile, refine=0)
    assert set(plan.modes.values()) == {"M", "C"}
    all_c = copy.deepcopy(model)
    set_modes(all_c, "C")
    plan.apply(model)
    assert get_modes(model) == plan.modes
    losses = []
    for net in (model, all_c):
        net.train()
        torch.manual_seed(1)
        loss = loss_fn(net(x), y)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-12)
    planned, reference = dict(model.named_parameters()), dict(all_c.named_parameters())
    for name, p in reference.items():
        assert p.grad is not None, name
        torch.testing.assert_close(planned[name].grad, p.grad, rtol=1e-10, atol=1e-10, msg=name)
    for (name, b), (_, b_ref) in zip(model.named_buffers(), all_c.named_buffers(), strict=True):
        torch.testing.assert_close(b, b_ref, rtol=1e-10, atol=1e-10, msg=name)


def test_a_plan_names_a_workload_that_differs_from_a_run():
    plan = Plan(modes={"b": "C"}, budget_bytes=1, granularity=1, predicted_step_time_s=0.1,
                predicted_peak_bytes=1, batch_size=8, input_shape=(512,))
    assert plan.workload_mismatch(8, (512,)) is None
    assert plan.workload_mismatch(8, (1024,)) == "the plan was solved for sequence length 512 (this run: 1024)"
    assert plan.workload_mismatch(4, (1024,)) == (
        "the plan was solved for batch size 8 (this run: 4) and sequence length 512 (this run: 1024)"
    )
    image = Plan(modes={"b": "C"}, budget_bytes=1, granularity=1, predicted_step_time_s=0.1,
                 predicted_peak_bytes=1, batch_size=8, input_shape=(3, 32, 32))
    assert image.workload_mismatch(8, (3, 16, 16)) == "the plan was solved for samples of shape 3x32x32 (this run: 3x16x16)"
    # A plan saved before the sample shape was recorded holds the batch size only.
    saved = json.loads(image.to_json())
    del saved["payload"]["input_shape"]
    old = Plan.from_json(json.dumps(saved))
    assert old.input_shape is None and old.workload_mismatch(8, (3, 16, 16)) is None
    assert Plan.from_json(plan.to_json()).input_shape == (512,)


def test_make_plan_records_the_profiled_sample_shape(tiny_profiled):
    _, _, profile = tiny_profiled
    assert make_plan(profile, 10**9).input_shape == (3, 12, 12)


def test_a_vit_is_built_for_the_image_side_it_is_planned_at():
    # A ViT's patch grid is fixed when it is built: planning it at 16x16 builds it for 16x16.
    spec = input_spec("revvit_cifar", input_size=(3, 16, 16))
    model = create_model_for("revvit_cifar", spec)
    x, _ = spec.example(2)
    assert model(x).shape == (2, 10)
    assert len(reversible_blocks(model)) == 6
