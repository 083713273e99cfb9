"""The API's limits and checks: bodies, prompts, ``max_tokens``, one client's share of the swarm, Host, Origin and
Content-Type, the errors of odd fields, a busy port. Against a bootstrap node and no stages: each refusal here comes
before a chain is sought (a request that passes every check gets 503 ``no_chain``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from .conftest import KEY, ApiThread

httpx = pytest.importorskip("httpx")

CONTEXT = 32768  # the made model's max_position_embeddings
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def boot(model_dir, tmp_path_factory):
    from sangama_p2p.cli.local_fleet import LocalFleet

    with LocalFleet(model_dir, [], tmp_path_factory.mktemp("limits-boot")) as f:
        yield f


@pytest.fixture(scope="module")
def server(model_dir, boot, key_file):
    with ApiThread(model_dir, boot.bootstrap_addr, key_file, max_body_bytes=1_000_000,
                   max_requests_per_client=2) as s:
        yield s


def _post(url: str, body: object, headers: dict | None = None, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={**AUTH, **(headers or {})}, timeout=60)


def _error(res: httpx.Response, status: int) -> dict:
    assert res.status_code == status, res.text
    return res.json()["error"]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 10**12}, "max_tokens"),
    ('"max_tokens": 1e12', "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),  # over --max-tokens-cap (4096)
    ({"seed": 2**70}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_p": 0}, "top_p"),
    (f'"prompt": {_deep(200_000)}', "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"stop": 5}, "stop"),
    ({"prompt": [1] * (CONTEXT + 1)}, "prompt"),  # over the model's context: not 429
    ({"prompt": [1] * 30_000, "max_tokens": 4000}, "max_tokens"),  # prompt + max_tokens over the context
    ({"prompt": "a" * (16 * CONTEXT + 1)}, "prompt"),  # over --max-prompt-chars: refused before tokenizing
])
def test_odd_fields_are_400_naming_the_field(server, body, param):
    if isinstance(body, str):  # raw JSON members after the model
        raw = '{"model": "made", "prompt": "hi", ' + body + "}"
    else:
        raw = json.dumps({"model": "made", "prompt": "hi", **body})
    err = _error(_post(server.url, raw), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_chat_fields_and_a_top_level_deep_body(server):
    err = _error(_post(server.url, {"model": "made", "messages": "hi"}, path="/v1/chat/completions"), 400)
    assert err["param"] == "messages"
    long = [{"role": "user", "content": "a" * (16 * CONTEXT + 1)}]
    err = _error(_post(server.url, {"model": "made", "messages": long}, path="/v1/chat/completions"), 400)
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    err = _error(_post(server.url, _deep(200_000)), 400)
    assert err["type"] == "invalid_request_error"


def test_a_prompt_over_the_context_in_tokens(server, local):
    text = "hello world " * (CONTEXT // 2)
    assert CONTEXT < len(local.tokenizer.encode(text)) and len(text) < 16 * CONTEXT
    err = _error(_post(server.url, {"model": "made", "prompt": text}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert _error(_post(server.url, {"model": "made", "prompt": "hi"}), 503)["code"] == "no_chain"  # checks passed


def test_a_body_over_the_limit_is_413(server):
    big = json.dumps({"model": "made", "prompt": "a" * 1_100_000})
    err = _error(_post(server.url, big), 413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: read in chunks until the limit
        for _ in range(40):
            yield b"a" * 65536

    res = httpx.post(server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert _error(res, 413)["code"] == "request_too_large"


def test_content_type_host_and_origin(server, key_file):
    url, ok = server.url, {"model": "made", "prompt": "hi", "n": 2}  # passes every check, then 400 on n
    port = url.rsplit(":", 1)[1]
    assert _error(_post(url, ok, {"Content-Type": "text/plain"}), 415)["code"] == "unsupported_media_type"
    assert _error(_post(url, ok, {"Content-Type": ""}), 415)["code"] == "unsupported_media_type"
    assert _error(_post(url, ok, {"Content-Type": "application/json; charset=utf-8"}), 400)["param"] == "n"
    assert _error(_post(url, ok, {"Origin": "http://evil.example"}), 403)["code"] == "origin_not_allowed"
    assert _error(_post(url, ok, {"Origin": url}), 400)["param"] == "n"  # its own origin
    assert _error(_post(url, ok, {"Host": f"evil.example:{port}"}), 403)["code"] == "host_not_allowed"
    assert _error(_post(url, ok, {"Host": f"localhost:{port}"}), 400)["param"] == "n"
    res = httpx.get(url + "/v1/models", headers={**AUTH, "Host": f"rebound.example:{port}"})
    assert _error(res, 403)["code"] == "host_not_allowed"

    from sangama_p2p.api import ApiConfig

    other = server.serve(ApiConfig(port=0, api_key_file=key_file, allowed_hosts=("api.example",),
                                   allowed_origins=("http://app.example",)))
    assert _error(_post(other, ok, {"Host": "api.example", "Origin": "http://app.example"}), 400)["param"] == "n"
    assert _error(_post(other, ok, {"Origin": "http://evil.example"}), 403)["code"] == "origin_not_allowed"
    pre = httpx.options(other + "/v1/completions", headers={"Origin": "http://app.example",
                                                            "Access-Control-Request-Method": "POST",
                                                            "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"


def _held_request(url: str) -> socket.socket:
    """A request whose body never finishes: it holds one of its client's slots until the socket closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
    return sock


def _until(status: int, url: str, body: dict, timeout: float = 20) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        res = _post(url, body)
        if res.status_code == status or time.monotonic() > deadline:
            return res
        time.sleep(0.05)


def test_one_client_runs_at_most_its_share_of_requests(server):
    ok = {"model": "made", "prompt": "hi", "n": 2}
    held = [_held_request(server.url) for _ in range(2)]
    try:
        err = _error(_until(429, server.url, ok), 429)
        assert err["code"] == "too_many_requests" and err["type"] == "rate_limit_error"
        held.pop().close()  # a client gone mid-body frees its slot
        assert _error(_until(400, server.url, ok), 400)["param"] == "n"
    finally:
        for s in held:
            s.close()


def _api_proc(model_dir, boot, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "api", "--model", str(model_dir),
                             "--bootstrap", boot.bootstrap_addr, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_busy_port_is_one_line(model_dir, boot):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _api_proc(model_dir, boot, "--port", str(port))
        out, err = proc.communicate(timeout=90)
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"sangama-peer: error: port {port} on 127.0.0.1 is in use"], err


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:  # VmHWM back to the process's present size (Linux >= 4.0)
        f.write("5")


def _peak_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_100_mb_body_is_refused_without_growing_the_api(model_dir, boot):
    """The default limit (4 MiB): the body is read in chunks and the reading stops there."""
    proc = _api_proc(model_dir, boot, "--port", "0")
    try:
        line = proc.stdout.readline()
        assert line.startswith("api listening http://"), line + proc.stderr.read()
        host, port = line.split()[2].removeprefix("http://").rsplit(":", 1)
        _reset_peak(proc.pid)
        before = _peak_kb(proc.pid)
        sock = socket.create_connection((host, int(port)))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n" % (1 << 20) + b"a" * (1 << 20) + b"\r\n"

        def send() -> None:
            try:
                for _ in range(100):
                    sock.sendall(chunk)
                sock.sendall(b"0\r\n\r\n")
            except OSError:  # the server closed the connection after its answer
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sock.settimeout(60)
        head = sock.recv(4096).decode(errors="replace")
        sender.join(timeout=60)
        sock.close()
        grown_mb = (_peak_kb(proc.pid) - before) / 1024
        assert head.startswith("HTTP/1.1 413"), head
        assert grown_mb < 4 + 16, f"the API's peak memory grew by {grown_mb:.0f} MB"
        print(f"100 MB body: the API's peak memory grew by {grown_mb:.1f} MB")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
