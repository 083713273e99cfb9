"""Output held to a grammar at the last stage (model/constraint.py, ``Decoder(constraint=...)``): what the grammar
allows, how it follows, rolls back and rebuilds from a session's tokens, and decodes that end in valid JSON."""

from __future__ import annotations

import json

import pytest
import torch

from sangama_p2p.errors import ModelError, SessionStateError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.constraint import TokenConstraint, json_grammar, load_grammar_tokenizer
from sangama_p2p.model.decode import Decoder, LastStep, finish_steps
from sangama_p2p.model.sampling import SamplingParams
from sangama_p2p.model.speculative import GuessPolicy
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.positions import ring_size

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}
PROMPT = [3, 17, 42, 8, 99]


@pytest.fixture(scope="module")
def llama(checkpoints):
    ck = open_checkpoint(checkpoints["made-llama"])
    return ck, load_grammar_tokenizer(checkpoints["made-llama"])


def _ids(ck, text: str) -> list[int]:
    ids = ck.tokenizer.encode(text)
    assert ck.tokenizer.decode(ids) == text
    return ids


def test_the_grammar_follows_rolls_back_and_refuses(llama):
    ck, gt = llama
    c = TokenConstraint(gt, json_grammar(SCHEMA), len(PROMPT))
    width = ck.spec.vocab_size
    c.follow(0, PROMPT)  # the prompt is not the grammar's
    first = c.allowed(width)
    assert first.nonzero().flatten().tolist() == [ck.tokenizer.token_id("{")]
    body = _ids(ck, '{"a":2,"b":true}')
    c.follow(len(PROMPT), body)
    assert c.allowed(width).nonzero().flatten().tolist() == list(ck.spec.eos_token_ids)  # complete: only the end
    c.follow(len(PROMPT) + 3, body[3:])  # a step that rewrites what it had: rolled back, followed again
    assert c.end == len(PROMPT) + len(body)
    c.follow(len(PROMPT), body[:1])  # a rollback to the first token
    assert c.end == len(PROMPT) + 1 and not torch.equal(c.allowed(width), first)
    c.follow(0, PROMPT)  # back to before the grammar's start: its initial state again
    assert torch.equal(c.allowed(width), first)
    with pytest.raises(SessionStateError, match="breaks the grammar"):
        c.follow(len(PROMPT), _ids(ck, "[1]"))
    fresh = TokenConstraint(gt, json_grammar(SCHEMA), len(PROMPT))
    with pytest.raises(SessionStateError, match="skips"):
        fresh.follow(len(PROMPT) + 2, body[2:])
    masked = fresh.mask(torch.zeros(width + 3))  # scores past the tokenizer's words are never allowed
    assert int(torch.isfinite(masked).sum()) == 1 and torch.isinf(masked[-3:]).all()


def test_invalid_grammars_and_schemas_are_model_errors(llama):
    ck, gt = llama
    with pytest.raises(ModelError, match="cannot compile"):
        json_grammar({"type": "quaternion"})
    with pytest.raises(ModelError, match="invalid grammar"):
        TokenConstraint(gt, '{"grammars": [{"nope": 1}]}', 0)
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    state = stage.new_session(32, ring=ring_size(2))
    with pytest.raises(ModelError, match="no guesses"):
        Decoder(state, SamplingParams(), GuessPolicy(2), constraint=TokenConstraint(gt, json_grammar(None), 0))


def _decode(stage: StageModel, gt, sampling: SamplingParams, max_new: int = 40) -> list[int]:
    state = stage.new_session(len(PROMPT) + max_new + 1)
    dec = Decoder(state, sampling, GuessPolicy(0), constraint=TokenConstraint(gt, json_grammar(SCHEMA), len(PROMPT)))
    start, step, out = 0, list(PROMPT), []
    for _ in range(max_new):
        x = stage.forward([StepInput(state, start, tokens=torch.tensor(step))])
        (res,) = finish_steps(stage, [LastStep(dec, start, step, 0)], x)
        out.extend(res.tokens)
        if res.tokens[-1] in stage.spec.eos_token_ids:
            break
        start, step = start + len(step), [res.tokens[-1]]
    return out


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, 1.0, 7), SamplingParams(1.5, 0.9, 3)],
                         ids=["greedy", "t1", "t1.5-top-p"])
def test_a_random_model_held_to_a_schema_writes_valid_json(llama, sampling):
    ck, gt = llama
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    out = _decode(stage, gt, sampling)
    assert out[-1] in ck.spec.eos_token_ids, ck.tokenizer.decode(out)
    value = json.loads(ck.tokenizer.decode(out[:-1]))
    assert value["a"] in (1, 2, 3) and isinstance(value["b"], bool) and set(value) == {"a", "b"}


def test_a_replay_rebuilds_the_grammar_from_the_tokens_so_far(llama):
    """After a failover the new last stage prefills the prompt and the tokens so far in one step: its grammar
    follows them and allows what the first one's allowed at the same point."""
    ck, gt = llama
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    out = _decode(stage, gt, SamplingParams())
    for cut in (1, 3, len(out) - 1):
        a = TokenConstraint(gt, json_grammar(SCHEMA), len(PROMPT))
        for i in range(cut):  # step by step, as the first chain went
            a.follow(len(PROMPT) + i - 1 if i else 0, [out[i - 1]] if i else PROMPT)
        a.follow(len(PROMPT) + cut - 1, [out[cut - 1]])
        b = TokenConstraint(gt, json_grammar(SCHEMA), len(PROMPT))
        b.follow(0, PROMPT + out[:cut])  # the replay
        assert a.end == b.end and torch.equal(a.allowed(ck.spec.vocab_size), b.allowed(ck.spec.vocab_size))
