"""Tool calls: tools laid out by the checkpoint's own template (transformers' ``apply_chat_template`` is the oracle on
Qwen3.5's template from the llama.cpp-converted fixture), the Hermes fallback for a template without tools (the real
SmolLM2 file), calls read back in the form each template writes them, and the grammar of a forced call checked token
by token with llguidance on SmolLM2's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sangama_p2p.errors import ModelError
from sangama_p2p.model.chat import load_chat_template, render_text
from sangama_p2p.model.tool_calls import (ToolCall, ToolFormat, call_grammar, parse_tool_calls, prepare_messages,
                                          tool_format)

QWEN35 = Path("/work/shared/fixtures/gguf/qwen35moe-h16/tiny-qwen35moe-F32.gguf")  # as tests/gguf/helpers.py
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "sunny"}'},
]


@pytest.fixture(scope="module")
def qwen35():
    if not QWEN35.is_file():
        pytest.skip("the shared GGUF fixtures are not here")
    return load_chat_template(QWEN35)


@pytest.fixture(scope="module")
def smol_grammar(smollm2_gguf: Path):
    """(llguidance's view of SmolLM2's vocabulary, its tokenizer)."""
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.constraint import load_grammar_tokenizer

    return load_grammar_tokenizer(smollm2_gguf), open_checkpoint(smollm2_gguf, tokenizer=True).tokenizer


def test_the_format_is_read_from_the_template(qwen35, smollm2_gguf: Path) -> None:
    assert tool_format(qwen35.source) == ToolFormat("xml", True)
    assert tool_format(load_chat_template(smollm2_gguf).source) == ToolFormat("hermes", False)
    assert tool_format("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>") == ToolFormat("hermes", True)
    assert tool_format(None) == ToolFormat("hermes", False)


def test_a_native_template_renders_tools_and_history_as_transformers_does(qwen35) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages, tools = prepare_messages(HISTORY, TOOLS, tool_format(qwen35.source))
    ours = render_text(qwen35, messages, tools=tools)
    # transformers' convention: arguments as objects
    theirs_messages = json.loads(json.dumps(HISTORY))
    theirs_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
    theirs, _ = render_jinja_template(conversations=[theirs_messages], tools=TOOLS, chat_template=qwen35.source,
                                      add_generation_prompt=True)
    assert ours == theirs[0]
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in ours
    assert '<tool_response>\n{"temp_c": 18, "sky": "sunny"}\n</tool_response>' in ours


def test_a_template_without_tools_gets_them_in_a_system_message(smollm2_gguf: Path) -> None:
    template = load_chat_template(smollm2_gguf)
    fmt = tool_format(template.source)
    messages, tools = prepare_messages([{"role": "system", "content": "Be brief."}, *HISTORY,
                                        {"role": "tool", "tool_call_id": "call_2", "content": "second"}], TOOLS, fmt)
    assert tools is None
    text = render_text(template, messages)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text and json.dumps(CLOCK) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
            '\n</tool_call><|im_end|>') in text
    # consecutive tool results are one user turn, as Qwen's templates write them
    assert ('<|im_start|>user\n<tool_response>\n{"temp_c": 18, "sky": "sunny"}\n</tool_response>\n<tool_response>\n'
            'second\n</tool_response><|im_end|>') in text
    assert text.endswith("<|im_start|>assistant\n")


def test_arguments_that_are_not_a_json_object_are_refused() -> None:
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "get_time", "arguments": "{oops"}}]}]
    with pytest.raises(ModelError, match="not JSON"):
        prepare_messages(bad, TOOLS, ToolFormat("hermes", False))
    with pytest.raises(ModelError, match="not a JSON object"):
        prepare_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
                         TOOLS, ToolFormat("xml", True))


def _written_call(template, name: str, args: dict) -> str:
    """What ``template`` writes for an assistant turn of one call (the text between the turn's start and end)."""
    fmt = tool_format(template.source)
    turn = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": name, "arguments": args}}]}]
    messages, tools = prepare_messages(turn, TOOLS, fmt)
    text = render_text(template, messages, tools=tools, add_generation_prompt=False)
    body = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    return body[:body.rindex("<|im_end|>")]


@pytest.mark.parametrize("args", [{"city": "New York", "days": 3, "units": "F"}, {"city": "Rome\nItaly"}, {}])
def test_calls_read_back_as_each_template_writes_them(qwen35, smollm2_gguf: Path, args: dict) -> None:
    for template in (qwen35, load_chat_template(smollm2_gguf)):
        written = _written_call(template, "get_weather", args)
        content, calls = parse_tool_calls(written, tool_format(template.source), TOOLS)
        assert calls == [ToolCall("get_weather", json.dumps(args))], written
        assert content is None or content.startswith("<think>")  # Qwen3.5 writes an empty thinking block first


def test_text_that_is_not_a_call_stays_content() -> None:
    hermes = ToolFormat("hermes", False)
    assert parse_tool_calls("Paris is sunny.", hermes, TOOLS) == ("Paris is sunny.", [])
    for text in ['<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # not one of the tools
                 '<tool_call>\n{"name": "get_time", "arguments": {}\n</tool_call>',  # broken JSON
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> and more words']:
        assert parse_tool_calls(text, hermes, TOOLS) == (text, [])
    content, calls = parse_tool_calls('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
                                      '\n<tool_call>\n[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
                                      hermes, TOOLS)  # the last block unclosed: the model stopped there
    assert content == "Let me look."
    assert calls == [ToolCall("get_time", "{}"), ToolCall("get_weather", '{"city": "Oslo"}')]


def _follows(grammar: str, text: str, smol_grammar) -> bool:
    from sangama_p2p.errors import SessionStateError
    from sangama_p2p.model.constraint import TokenConstraint

    vocab, tokenizer = smol_grammar
    constraint = TokenConstraint(vocab, grammar, 0)
    try:
        constraint.follow(0, tokenizer.encode(text))
    except SessionStateError:
        return False
    return constraint.matcher.is_accepting()


def test_the_forced_grammar_takes_exactly_calls_the_template_writes(qwen35, smollm2_gguf: Path, smol_grammar) -> None:
    args = {"city": "Paris", "days": 2}
    for template in (qwen35, load_chat_template(smollm2_gguf)):
        fmt = tool_format(template.source)
        written = _written_call(template, "get_weather", args)
        call = written[written.index("<tool_call>"):]
        named = call_grammar(TOOLS, fmt, only="get_weather", parallel=False)
        assert _follows(named, call, smol_grammar)
        assert not _follows(named, call + "\n" + call, smol_grammar)  # one call only
        assert _follows(call_grammar(TOOLS, fmt), call + "\n" + call, smol_grammar)  # parallel calls
        assert not _follows(call_grammar(TOOLS, fmt, only="get_time"), call, smol_grammar)  # the other tool
        assert not _follows(named, "Sure! " + call, smol_grammar)  # nothing before the call
        assert not _follows(named, call.replace("2", '"two"'), smol_grammar)
        think = call_grammar(TOOLS, fmt, only="get_weather", open_think=True)
        assert _follows(think, "I need the weather.\n</think>\n\n" + call, smol_grammar)
    hermes = call_grammar(TOOLS, ToolFormat("hermes", False), only="get_weather", parallel=False)
    assert not _follows(hermes, '<tool_call>\n{"name": "get_weather", "arguments": {"days": 1}}\n</tool_call>',
                        smol_grammar)  # city is required
    with pytest.raises(ModelError, match="no tool named"):
        call_grammar(TOOLS, ToolFormat("hermes", False), only="nope")
