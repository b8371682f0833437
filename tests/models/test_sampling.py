"""Generation from language models: greedy is the argmax, sampling is seeded, context is respected."""

import pytest
import torch

from revtrain.core import set_modes
from revtrain.models import create_model
from revtrain.models.sampling import generate, sample_text
from revtrain.tasks import LanguageModeling


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds spin-waiting on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return create_model("revformer_tiny").train()


def test_greedy_picks_the_argmax_of_the_last_position(model):
    prompt = [104, 105]
    out = generate(model, prompt, 5, temperature=0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(model.eval()(torch.tensor([ids]))[0, -1].argmax()))
    model.train()
    assert out.tolist() == ids[2:]
    assert generate(model, prompt, 5, top_k=1, generator=torch.Generator().manual_seed(9)).tolist() == ids[2:]


def test_sampling_is_seeded_and_restores_the_training_mode(model):
    def draw(seed):
        return generate(model, [1, 2, 3], 12, temperature=1.5, top_k=50, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))
    assert model.training


def test_only_the_last_context_tokens_are_seen(model):
    long_prompt = list(range(40, 80))  # 40 tokens, context 16
    assert torch.equal(generate(model, long_prompt, 6, temperature=0), generate(model, long_prompt[-16:], 6, temperature=0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[], length=3), "prompt is empty"),
    (dict(prompt=[1], length=-1), "length"),
    (dict(prompt=[1], length=3, temperature=-1.0), "temperature"),
    (dict(prompt=[1], length=3, top_k=0), "top_k"),
    (dict(prompt=torch.tensor([[100, 101], [1, 2]]), length=3), r"one prompt; got ids of shape \(2, 2\)"),
])
def test_bad_arguments(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)


def test_a_trained_model_continues_the_text_it_learned():
    """End to end: M-mode training with the language-modelling task, then greedy sampling."""
    torch.manual_seed(0)
    model = create_model("revformer_tiny")
    set_modes(model, "M")
    text = torch.tensor(list(b"hello world! " * 20))
    task = LanguageModeling()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(120):
        starts = torch.randint(0, len(text) - 17, (8,), generator=gen)
        window = torch.stack([text[s : s + 17] for s in starts])
        loss = task.loss(model(window[:, :-1]), window[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1
    assert sample_text(model, "hello w", 18, temperature=0) == "hello world! hello world!"


def test_a_model_without_a_context_is_asked_whether_it_is_a_language_model():
    from revtrain.models import create_model

    with pytest.raises(ValueError, match="no `context` attribute: is it a language model"):
        generate(create_model("revnet38"), [1, 2], 3)
