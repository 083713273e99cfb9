"""``response_format`` through the official ``openai`` client, over three stage processes serving the real
SmolLM2-135M-Instruct (Q4_1 GGUF): every reply parses and follows its schema (``jsonschema`` is the oracle).

The file is linked as ``made.gguf`` so that its model id is the one the API fixtures' client asks for.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from .conftest import openai_client, smol_api_over  # noqa: E402

MODEL = "made"
SPLIT = ["0:10", "10:20", "20:30"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Rome", "Berlin"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = ["Ann, 31, from Paris", "Bob, 45, from London", "Chiara, 27, from Rome", "Dieter, 60, from Berlin",
          "Eve, 19, from Paris"]


@pytest.fixture(scope="module")
def smol_api(smol, key_file, tmp_path_factory):
    yield from smol_api_over(smol, SPLIT, key_file, tmp_path_factory)


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_twenty_schema_requests_give_twenty_valid_replies(smol_api):
    """Greedy and sampled, chat and streamed: each reply is JSON that validates against the schema."""
    client = openai_client(smol_api)
    replies = []
    for i in range(20):
        person = PEOPLE[i % len(PEOPLE)]
        messages = [{"role": "user", "content": f"Describe {person} as a JSON object with name, age and city."}]
        kwargs = {"temperature": 0.0} if i < 10 else {"temperature": 0.9, "seed": i}
        if i % 4 == 3:  # streamed: the deltas joined are the reply
            stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, stream=True,
                                                    response_format=_schema_format(PERSON), **kwargs)
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish == ["stop"]
        else:
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                                   response_format=_schema_format(PERSON), **kwargs)
            text = reply.choices[0].message.content
            assert reply.choices[0].finish_reason == "stop"
        value = json.loads(text)
        jsonschema.validate(value, PERSON)
        replies.append(value)
    assert len(replies) == 20
    assert len({json.dumps(v, sort_keys=True) for v in replies}) > 1  # the prompts (and the sampling) still matter


def test_json_object_and_a_completion_hold_to_json(smol_api):
    client = openai_client(smol_api)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about the planet Mars."}],
        max_tokens=80, temperature=0.0, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # the token budget ran out inside the object: what came is still a prefix the grammar allowed
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content.startswith("{")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    done = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer in JSON: ", max_tokens=20,
                                     temperature=0.0, extra_body={"response_format": _schema_format(schema)})
    jsonschema.validate(json.loads(done.choices[0].text), schema)


def test_unconstrained_replies_are_unchanged_and_bad_formats_are_400(smol_api):
    client = openai_client(smol_api)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.0)
    text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content
    assert plain.choices[0].message.content.startswith("The capital of France is Paris")
    for fmt in ({"type": "yaml"}, _schema_format({"type": "quaternion"})):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format=fmt)
        assert err.value.body["param"] == "response_format"
