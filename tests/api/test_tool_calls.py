"""Tool calls through the official ``openai`` client, over three stage processes serving the real
SmolLM2-135M-Instruct (Q4_1 GGUF; its template takes no tools, so they go in the Hermes layout of a system message):
a forced call comes back as ``tool_calls`` with arguments that follow the tool's schema, streamed too, and the tool's
result goes back in for the model's answer."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from .conftest import openai_client, smol_api_over  # noqa: E402

MODEL = "made"
SPLIT = ["0:10", "10:20", "20:30"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smol_api(smol, key_file, tmp_path_factory):
    yield from smol_api_over(smol, SPLIT, key_file, tmp_path_factory)


@pytest.fixture(scope="module")
def client(smol_api):
    return openai_client(smol_api)


def _check(call, tool=WEATHER) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_a_forced_call_round_trips(client, smol) -> None:
    """The named tool is called (greedy), its result goes back as a tool message, and the model answers in text."""
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    args = _check(choice.message.tool_calls[0])
    assert "paris" in args["city"].lower()
    call = choice.message.tool_calls[0]
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, CLOCK], max_tokens=40,
                                            temperature=0.0, tool_choice="none")
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    # the prompt the server built holds the call and the result, laid out as the unit tests check
    # (tests/model/test_tool_calls.py): the same ids as rendering the history here
    from sangama_p2p.api.server import served_model
    from sangama_p2p.model.chat import render_chat
    from sangama_p2p.model.tool_calls import prepare_messages, tool_format

    served = served_model(smol)
    messages, _ = prepare_messages(history, [WEATHER, CLOCK], tool_format(served.template.source))
    prompt = render_chat(served.template, served.tokenizer, messages)
    assert '<tool_response>\n{"temperature": 18, "sky": "sunny"}\n</tool_response>' in prompt.text
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in prompt.text
    assert answer.usage.prompt_tokens == len(prompt.ids)


def test_a_required_call_streams_as_tool_call_deltas(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60,
                                            temperature=0.0, tool_choice="required", parallel_tool_calls=False,
                                            stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [t for d in deltas for t in (d.tool_calls or ())]
    assert len(calls) == 1 and calls[0].index == 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    tool = WEATHER if calls[0].function.name == "get_weather" else CLOCK
    _check(calls[0], tool)
    # the same request not streamed gives the same call (greedy)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60,
                                           temperature=0.0, tool_choice="required", parallel_tool_calls=False)
    assert reply.choices[0].message.tool_calls[0].function.model_dump() == calls[0].function.model_dump()


def test_auto_gives_text_or_calls_and_none_gives_text(client) -> None:
    """With ``auto`` the model chooses (a reply is either plain content or well-formed calls); ``none`` never calls."""
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60,
                                               temperature=0.0, tool_choice=choice)
        message = reply.choices[0].message
        if message.tool_calls:
            assert choice == "auto" and reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                _check(call)
        else:
            assert message.content and reply.choices[0].finish_reason in ("stop", "length")


def test_bad_tools_are_400s_naming_the_field(client) -> None:
    cases = [({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
        assert info.value.body["param"] == param, info.value.body
