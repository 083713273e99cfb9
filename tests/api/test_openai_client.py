"""The official ``openai`` client (and ``curl -N``) against the API over 3 stage processes (and a spare) on loopback.

The tests share one fleet and run in file order: the last one kills stages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
import httpx  # noqa: E402  (openai depends on it)

from .conftest import KEY  # noqa: E402

MODEL = "made"


def _client(api, key: str = KEY):
    return openai.OpenAI(base_url=api.url + "/v1", api_key=key, timeout=60, max_retries=0)


def _want(local, ids, max_new, stops):
    from sangama_p2p.model.sampling import SamplingParams

    return local.generate(ids, max_new, SamplingParams(), guesses="auto", stop_tokens=stops).tokens


def _chat_prompt(model_dir, local, messages):
    from sangama_p2p.model.chat import load_chat_template, render_chat

    p = render_chat(load_chat_template(model_dir), local.tokenizer, messages)
    return list(p.ids), tuple(p.stop_ids)


def test_models_auth_and_request_errors(api):
    health = httpx.get(api.url + "/health", timeout=30)  # no key: what probes and load balancers ask
    assert health.status_code == 200 and health.json() == {"status": "ok", "models": 1}
    client = _client(api)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.AuthenticationError) as err:
        _client(api, "sk-wrong").models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", n=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", temperature=5)
    assert err.value.body["param"] == "temperature" and set(err.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as err:  # over --max-tokens-cap: not a 429 that clients retry
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    assert err.value.body["param"] == "max_tokens"


def test_completion_and_chat_equal_the_local_chain(api, local, model_dir):
    client = _client(api)
    ids = local.tokenizer.encode("The quick brown fox")
    want = _want(local, ids, 12, local.spec.eos_token_ids)
    res = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    choice = res.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.text == local.tokenizer.decode([t for t in want if t not in local.spec.eos_token_ids])
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == len(want)
    assert choice.finish_reason == ("stop" if want[-1] in local.spec.eos_token_ids else "length")

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    cids, stops = _chat_prompt(model_dir, local, messages)
    want = _want(local, cids, 10, stops)
    res = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert res.choices[0].model_extra["token_ids"] == want
    text = res.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == text and tokens == want
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # token by token, not at once
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_a_stop_string_cuts_the_text_and_ends_the_generation(api, local):
    client = _client(api)
    full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0)
    text = full.choices[0].text
    at = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isprintable() and not text[i:i + 2].isspace()
              and "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    cut = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=16, temperature=0, stop=stop, stream=True) if c.choices]
    assert "".join(pieces) == cut.choices[0].text


def test_sixteen_concurrent_streams_get_their_solo_tokens(api, local):
    prompts = [f"Request number {i} says" for i in range(16)]
    wants = [_want(local, local.tokenizer.encode(p), 6, local.spec.eos_token_ids) for p in prompts]
    client = _client(api)

    def one(prompt: str) -> list[int]:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        return [t for c in stream if c.choices for t in c.choices[0].model_extra["token_ids"]]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    assert got == wants, f"{time.perf_counter() - t0:.1f} s"


def _sessions(api):
    """The chain sessions of the generations running now on the API's peer (their ``_decode_trips`` say how far
    each got: one token a trip with ``guesses`` 0)."""
    import trio

    client = trio.from_thread.run(api.peer.client, "made", trio_token=api.token)
    return list(client.active.values())


def _wait_ended(api, sessions, what: str) -> None:
    """The generation's sessions close, and before its 3000 tokens: a count, not a time (issue 22 item 4); the
    60 s is only a bound against a hang (about 10 s of trips on the idle dev machine would end it anyway)."""
    t0 = time.monotonic()
    while api.routes() and time.monotonic() < t0 + 60:
        time.sleep(0.05)
    assert api.routes() == [], f"{what}: its sessions were still open 60 s after the client left"
    print(f"{what}: sessions freed {time.monotonic() - t0:.2f} s after its client left")
    assert sessions and all(s._decode_trips < 2990 for s in sessions), [s._decode_trips for s in sessions]


def test_a_client_that_hangs_up_ends_its_generation(api, local):
    import httpx

    body = {"model": MODEL, "prompt": "Hang up", "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True, "guesses": 0}  # about 10 s of trips
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as res:
            lines = res.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert api.routes()  # the generation is running
            sessions = _sessions(api)
    assert got
    _wait_ended(api, sessions, "a streamed request")  # its sessions were closed well before 3000 tokens


def test_a_client_that_hangs_up_on_a_request_not_streamed_ends_it(api):
    import socket

    body = json.dumps({"model": MODEL, "prompt": "Hang up", "max_tokens": 3000, "temperature": 0,
                       "ignore_eos": True, "guesses": 0}).encode()  # about 10 s of trips
    host, port = api.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while not api.routes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api.routes()  # the generation is running
    sessions = _sessions(api)
    sock.close()
    _wait_ended(api, sessions, "a request not streamed")


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_sangama_peer_api_through_curl(model_dir, fleet, key_file, local, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "api", "--model", str(model_dir),
                             "--bootstrap", fleet.bootstrap_addr, "--port", "0", "--api-key-file", str(key_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("api listening http://"), line + proc.stderr.read()
        url = line.split()[2]
        body = json.dumps({"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                           "stream": True})
        out = subprocess.run(["curl", "-N", "-sS", "--max-time", "60", "-H", f"Authorization: Bearer {KEY}",
                              "-H", "Content-Type: application/json", "-d", body, url + "/v1/completions"],
                             capture_output=True, text=True, timeout=90)
        events = [e for e in out.stdout.split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]", out.stdout
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert tokens == _want(local, local.tokenizer.encode("The quick brown fox"), 12, local.spec.eos_token_ids)
        bad = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                              "Authorization: Bearer nope", url + "/v1/models"], capture_output=True, text=True)
        assert bad.stdout == "401"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_stage_killed_mid_stream(api, fleet, local):
    """With a spare the stream completes with identical tokens; with none left, an error event ends it."""
    client = _client(api)
    ids = local.tokenizer.encode("Failover keeps")
    want = _want(local, ids, 24, local.spec.eos_token_ids)
    middle = {fleet.stage_ids[1]: fleet.children[2], fleet.stage_ids[3]: fleet.children[4]}
    for round_ in ("spare", "none"):
        stream = client.completions.create(model=MODEL, prompt=[ids], max_tokens=24, temperature=0, stream=True,
                                           extra_body={"guesses": 0})
        got, killed = [], None
        t0 = time.perf_counter()
        try:
            for chunk in stream:
                got.extend(chunk.choices[0].model_extra["token_ids"] if chunk.choices else [])
                if killed is None and len(got) >= 4:
                    victim = next(p for p in api.routes()[0] if p in middle)
                    middle.pop(victim).proc.kill()
                    killed = victim
        except openai.APIError as exc:
            assert round_ == "none", exc
            assert exc.body["code"] == "chain_failed" and exc.body["type"] == "bad_gateway"
            assert time.perf_counter() - t0 < 45
            continue
        assert round_ == "spare" and killed is not None
        assert got == want
    assert not middle
    # the API's /metrics (Prometheus text, through its parser) counts the re-route and the failed generation
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(api.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.labels == {"model": MODEL}}
    assert got["sangama_client_failovers_total"] >= 1 and got["sangama_client_failed_total"] >= 1
    assert got["sangama_client_generations_total"] >= 2 and got["sangama_client_tokens_total"] >= len(want)
    assert "sangama_client_liars_banned_total" in got and "sangama_client_unverified_trips_total" in got
    with pytest.raises(urllib.error.HTTPError) as info:  # behind the key
        urllib.request.urlopen(api.url + "/metrics", timeout=10)
    assert info.value.code == 401
