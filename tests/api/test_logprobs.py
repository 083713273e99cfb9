"""``logprobs`` / ``top_logprobs`` through the official ``openai`` client, over three stage processes serving the real
SmolLM2-135M-Instruct (Q4_1 GGUF), against a float32 log-softmax of the same model's logits computed here.

The file is linked as ``made.gguf`` so that its model id is the one the API fixtures' client asks for.
"""

from __future__ import annotations

import math

import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from .conftest import openai_client, smol_api_over  # noqa: E402

MODEL = "made"
SPLIT = ["0:10", "10:20", "20:30"]
TOL = 1e-3
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def smol_api(smol, key_file, tmp_path_factory):
    yield from smol_api_over(smol, SPLIT, key_file, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(smol):
    """``logprobs(prompt_ids, new_ids)``: float32 log-softmax rows [len(new), V] of the model's logits before each of
    ``new_ids``, computed step by step on three stages as the fleet computes them (a prefill, then one token a step)."""
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.stage import StageModel, StepInput

    ckpt = open_checkpoint(smol)
    models = [StageModel.load(ckpt.spec, ckpt.source, a, b) for a, b in ((0, 10), (10, 20), (20, 30))]

    def logprobs(prompt: list[int], new: list[int]) -> torch.Tensor:
        states = [m.new_session(len(prompt) + len(new) + 1) for m in models]
        rows, start, step = [], 0, list(prompt)
        with torch.no_grad():
            for tok in new:
                x = torch.tensor(step)
                for k, (m, st) in enumerate(zip(models, states)):
                    x = m.forward([StepInput(st, start, tokens=x) if k == 0 else StepInput(st, start, hidden=x)])
                rows.append(torch.log_softmax(models[-1].logits(x[-1:]).float(), dim=-1)[0])
                start, step = start + len(step), [tok]
        return torch.stack(rows)

    return logprobs


def _prompt_ids(smol, messages):
    from sangama_p2p.model.chat_model import open_chat_model
    from sangama_p2p.model.chat import render_chat

    m = open_chat_model(smol)
    return list(render_chat(m.template, m.tokenizer, messages).ids)


def _check_against(ref: torch.Tensor, ids: list[int], chosen: list[float], tops: list[list[tuple[int, float]]]):
    """Each returned value within TOL of the reference; greedy tokens are the reference's argmax."""
    assert len(ids) == len(chosen) == len(tops) == ref.shape[0]
    worst = 0.0
    for j, (tid, lp, top) in enumerate(zip(ids, chosen, tops)):
        assert tid == int(ref[j].argmax()), f"token {j} is not the argmax"
        worst = max(worst, abs(lp - float(ref[j, tid])))
        for i, v in top:
            worst = max(worst, abs(v - float(ref[j, i])))
    assert worst < TOL, worst
    return worst


def test_chat_logprobs_match_a_float32_softmax_streamed_and_not(smol_api, smol, reference):
    client = openai_client(smol_api)
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=5)
    choice = res.choices[0]
    ids = choice.model_extra["token_ids"]
    content = choice.logprobs.content
    assert len(content) == len(ids) == res.usage.completion_tokens
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert c.logprob == pytest.approx(values[0], abs=1e-6)  # greedy: the chosen token is the most likely
        assert math.exp(c.logprob) == pytest.approx(max(math.exp(v) for v in values), abs=1e-6)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
        assert c.token == c.top_logprobs[0].token and c.bytes == list(c.token.encode())
    ref = reference(_prompt_ids(smol, MESSAGES), ids)
    # the returned top-5 values, against the reference's own top-5 (token strings need not map back to one id)
    tops = [list(zip(ref[j].topk(5).indices.tolist(), [t.logprob for t in c.top_logprobs]))
            for j, c in enumerate(content)]
    worst = _check_against(ref, ids, [c.logprob for c in content], tops)
    print(f"chat: {len(ids)} tokens, largest |logprob - float32 reference| {worst:.2e}")

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True)
    got = [c for chunk in stream for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert [c.token for c in got] == [c.token for c in content]
    assert [c.logprob for c in got] == pytest.approx([c.logprob for c in content], abs=1e-5)


def test_completion_logprobs_shapes_and_values(smol_api, smol, reference):
    from sangama_p2p.model.chat_model import open_chat_model

    client = openai_client(smol_api)
    prompt = "The capital of France is"
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    choice = res.choices[0]
    ids = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)
    tok = open_chat_model(smol).tokenizer
    ref = reference(tok.encode(prompt), ids)
    top_ids = [ref[j].topk(1).indices.tolist() for j in range(len(ids))]
    _check_against(ref, ids, lp.token_logprobs, [[(top_ids[j][0], lp.token_logprobs[j])] for j in range(len(ids))])

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                       stream=True)
    streamed = [v for chunk in stream for ch in chunk.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_sampled_tokens_carry_their_own_logprob(smol_api):
    """At temperature 1 the chosen token need not be the top one; its logprob is among the top list's when there."""
    res = openai_client(smol_api).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                                    seed=3, logprobs=True, top_logprobs=20)
    for c in res.choices[0].logprobs.content:
        values = {t.token: t.logprob for t in c.top_logprobs}
        assert c.logprob <= max(values.values()) + 1e-6
        if c.token in values:
            assert c.logprob == pytest.approx(values[c.token], abs=1e-6)


def test_logprobs_request_errors(smol_api):
    client = openai_client(smol_api)
    for kwargs, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"top_logprobs": 2}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=21)
    assert err.value.body["param"] == "logprobs"


def test_logprobs_of_steps_that_accept_guesses(api, local):
    """The made model drafts guesses (an MTP layer): a step returns several tokens, each with its own logprobs."""
    from sangama_p2p.model.sampling import SamplingParams

    client = openai_client(api, timeout=60)
    ids = local.tokenizer.encode("The quick brown fox")
    want = local.generate(ids, 16, SamplingParams(), guesses=4, stop_tokens=local.spec.eos_token_ids).tokens
    res = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                    logprobs=2, extra_body={"guesses": 4})
    choice = res.choices[0]
    assert choice.model_extra["token_ids"] == want
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(want)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen == pytest.approx(max(top.values()), abs=1e-6) and chosen <= 0
