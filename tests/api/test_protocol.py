"""The API's pure rules: request checks, stop strings, the HTTP status of each error, the [api] config table."""

from __future__ import annotations

import json

import pytest

from sangama_p2p.api import ApiConfig
from sangama_p2p.api.protocol import StopScanner, decode_body, error_for, fit_context, parse_request, prompt_chars
from sangama_p2p.client.session import ChainBroken, StageRefused
from sangama_p2p.errors import ApiError, ChatTemplateError, ErrorCode, RouteError, SangamaError
from sangama_p2p.peer import PeerConfig


def _parse(body, chat=False):
    return parse_request(body, chat=chat, default_max_tokens=7, default_guesses="auto", max_tokens_cap=100)


def test_parse_request_defaults_and_fields():
    r = _parse({"model": "m", "prompt": "hi"})
    assert (r.max_tokens, r.temperature, r.top_p, r.seed, r.stop, r.stream, r.guesses) == \
        (7, 1.0, 1.0, 0, (), False, "auto")
    r = _parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                "max_completion_tokens": 3, "max_tokens": 9, "stop": "x", "stream": True,
                "stream_options": {"include_usage": True}, "guesses": 4, "seed": 5}, chat=True)
    assert (r.max_tokens, r.stop, r.include_usage, r.guesses, r.seed) == (3, ("x",), True, 4, 5)
    assert r.messages[0]["content"] == "a"
    assert _parse({"model": "m", "prompt": [[1, 2]]}).prompt == (1, 2)
    assert _parse({"model": "m", "prompt": "x", "ignore_eos": True}).ignore_eos


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi"}, "model"),
    ({"model": "m", "prompt": "hi", "n": 2}, "n"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": "hi", "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "prompt": "hi", "guesses": 99}, "guesses"),
    ({"model": "m", "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "hi", "logprobs": True}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "logprobs": 1}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "response_format": {"type": "yaml"}},
     "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "response_format": "json"}, "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}],  # not a schema the engine can compile
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "quaternion"}}}},
     "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * 40_000]}}}}, "response_format"),
    ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "hi", "max_tokens": 101}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**12},
     "max_completion_tokens"),
    ({"model": "m", "prompt": "hi", "seed": 2**64}, "seed"),
    ({"model": "m", "prompt": "hi", "seed": -1}, "seed"),
    ({"model": "m", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
])
def test_bad_requests_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        _parse(body, chat="messages" in body)
    assert err.value.status == 400 and err.value.param == param


def test_logprobs_fields_parse_as_openai_defines_them():
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    assert _parse(chat, chat=True).top_logprobs is None
    assert _parse({**chat, "logprobs": False}, chat=True).top_logprobs is None
    assert _parse({**chat, "logprobs": True}, chat=True).top_logprobs == 0
    assert _parse({**chat, "logprobs": True, "top_logprobs": 20}, chat=True).top_logprobs == 20
    assert _parse({"model": "m", "prompt": "hi", "logprobs": 0}, chat=False).top_logprobs == 0
    assert _parse({"model": "m", "prompt": "hi", "logprobs": 5}, chat=False).top_logprobs == 5
    assert _parse({**chat, "response_format": {"type": "text"}}, chat=True).top_logprobs is None


def test_response_format_compiles_to_a_grammar_for_the_last_stage():
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    assert _parse(chat, chat=True).grammar is None
    assert _parse({**chat, "response_format": {"type": "text"}}, chat=True).grammar is None
    any_object = _parse({**chat, "response_format": {"type": "json_object"}}, chat=True).grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    typed = _parse({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                   chat=True).grammar
    assert any_object and typed and any_object != typed
    assert json.loads(typed)  # llguidance's JSON form, as the wire carries it


def test_decode_body_names_the_field_nested_too_deeply():
    deep = "[" * 200_000 + "]" * 200_000
    for raw, param in ((f'{{"model": "m", "prompt": {deep}}}', "prompt"), (deep, None),
                       (f'{{"a": 1, "stop" : {{"x": {deep}}}}}', "stop")):
        with pytest.raises(ApiError) as err:
            decode_body(raw.encode())
        assert err.value.status == 400 and err.value.param == param and "deep" in str(err.value)
    for raw in (b"{", b"\xff{}", b'{"a": 1e99999999999}x'):
        with pytest.raises(ApiError) as err:
            decode_body(raw)
        assert err.value.status == 400
    assert decode_body(b'{"model": "m", "prompt": [[1, 2]]}') == {"model": "m", "prompt": [[1, 2]]}


def test_the_context_bounds_prompt_and_max_tokens():
    r = _parse({"model": "m", "prompt": "hi"})  # max_tokens from the default: cut to what fits
    assert fit_context(r, 95, 100).max_tokens == 5 and fit_context(r, 10, 100).max_tokens == 7
    assert fit_context(r, 10, None) is r
    for req, n, param in ((r, 100, "prompt"), (_parse({"model": "m", "prompt": "hi", "max_tokens": 6}), 95,
                          "max_tokens"), (_parse({"model": "m", "messages": [{"role": "u", "content": "x"}]},
                                                 chat=True), 100, "messages")):
        with pytest.raises(ApiError) as err:
            fit_context(req, n, 100)
        assert err.value.status == 400 and err.value.param == param and err.value.code == "context_length_exceeded"
    chat = _parse({"model": "m", "messages": [{"role": "user", "content": "abc"}, {"role": "user"}]}, chat=True)
    assert prompt_chars(chat) == 3 and prompt_chars(r) == 2


def test_api_config_checks_its_limits():
    for bad in ({"max_body_bytes": 0}, {"max_tokens_cap": 0}, {"max_tokens": 300, "max_tokens_cap": 200},
                {"max_requests_per_client": -1}, {"max_prompt_chars": -1}, {"allowed_hosts": (5,)}):
        with pytest.raises(SangamaError):
            ApiConfig(**bad)
    assert ApiConfig(allowed_origins=["http://a.example/"]).allowed_origins == ("http://a.example",)


def test_stop_scanner_holds_back_a_possible_stop_and_cuts_at_the_first():
    s = StopScanner(["END", "xy"])
    out = [s.push(p) for p in ("ab", "cE", "N", "Dzz")]
    assert "".join(out) == "abc" and s.hit
    s = StopScanner(["END"])
    assert s.push("aE") == "" and s.push("Nx") == "aE" and s.flush() == "Nx" and not s.hit
    assert StopScanner([]).push("abc") == "abc"


def test_errors_map_to_openai_statuses():
    cap = StageRefused("CAPACITY: max_length", ErrorCode.CAPACITY, "peer")
    assert error_for(cap, started=False).status == 429
    assert error_for(RouteError("no live peer serves 'm'"), started=False).status == 503
    broke = RouteError("gave up")
    broke.__cause__ = ChainBroken("reset")
    assert error_for(broke, started=False).status == 502
    assert error_for(RouteError("x"), started=True).status == 502
    assert error_for(ChatTemplateError("bad"), started=False).status == 400
    assert error_for(SangamaError("?"), started=False).status == 502


def test_the_api_table_of_a_peer_config(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('[api]\nport = 9000\nhost = "0.0.0.0"\napi_key_file = "key"\nguesses = 2\n')
    api = PeerConfig.from_toml(path).api
    assert (api.port, api.host, api.api_key_file, api.guesses) == (9000, "0.0.0.0", tmp_path / "key", 2)
    path.write_text('[api]\nallowed_hosts = ["api.example"]\nmax_body_bytes = 1000\n')
    api = PeerConfig.from_toml(path).api
    assert (api.allowed_hosts, api.max_body_bytes) == (("api.example",), 1000)
    path.write_text('[api]\nport = "x"\n')
    with pytest.raises(SangamaError, match="port"):
        PeerConfig.from_toml(path)
    path.write_text('[api]\nnope = 1\n')
    with pytest.raises(SangamaError, match="nope"):
        PeerConfig.from_toml(path)
    path.write_text('[api]\nguesses = "lots"\n')
    with pytest.raises(SangamaError, match="guesses"):
        PeerConfig.from_toml(path)


def test_the_api_never_imports_the_stage_side():
    import ast
    from pathlib import Path

    import sangama_p2p.api

    names = set()
    for path in Path(sangama_p2p.api.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    assert names and not [n for n in names if "stage" in n.split(".")], sorted(names)


# ---- tools ----------------------------------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tools_are_parsed_and_checked() -> None:
    from sangama_p2p.api.tools import parse_tools

    assert parse_tools({}) is None
    assert parse_tools({"tools": [TOOL]}).choice == "auto"
    named = parse_tools({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                         "parallel_tool_calls": False})
    assert (named.choice, named.forced, named.parallel) == ("get_time", True, False)
    for body, match in [({"tools": [TOOL, TOOL]}, "twice"), ({"tools": [{"type": "code"}]}, "tools\\[0\\]"),
                        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice must"),
                        ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "boolean"),
                        ({"tool_choice": "auto"}, "needs tools"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "schema")]:
        with pytest.raises(ApiError, match=match):
            parse_tools(body)


def test_a_streamed_reply_holds_a_call_and_only_a_call() -> None:
    from sangama_p2p.api.tools import CallScanner, parse_tools
    from sangama_p2p.model.tool_calls import ToolCall, ToolFormat

    def run(pieces: list[str], choice: str = "auto") -> tuple[str, str, list]:
        scan = CallScanner(parse_tools({"tools": [TOOL], "tool_choice": choice}), ToolFormat("hermes", False))
        sent = "".join(scan.push(p) for p in pieces)
        rest, calls = scan.finish()
        return sent, rest, calls

    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert run(["Let me ", "check. <to", "ol_c", call[7:]]) == ("Let me check. ", "", [ToolCall("get_time", "{}")])
    assert run(["a <tool", "box> b <", "t"]) == ("a <toolbox> b ", "<t", [])  # held back only while it could start one
    assert run(["x ", call[:20]]) == ("x ", call[:20], [])  # a call cut short is content after all
    assert run([call], "none") == (call, "", [])
