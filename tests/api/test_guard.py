"""The API's gate, without a server: Host and Origin (DNS rebinding, cross-site requests), Content-Type, one client's
slots, a busy port, the warning for a keyless API off loopback."""

from __future__ import annotations

import logging
import socket

import pytest

from sangama_p2p.api import ApiConfig, ApiServer
from sangama_p2p.api.guard import ClientSlots, Gate, check_content_type, check_port
from sangama_p2p.errors import ApiError, SangamaError


def _refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args)
    return err.value


def test_on_loopback_only_its_own_names_are_hosts():
    gate = Gate("127.0.0.1", (), ())
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "127.0.0.1", None):
        gate.check_host(host)
    for host in ("evil.example:8000", "127.0.0.1.evil.example", "192.168.1.5:8000", ""):
        assert _refused(gate.check_host, host).status == 403
    Gate("127.0.0.1", ("api.example",), ()).check_host("api.example:8000")
    Gate("127.0.0.1", ("*",), ()).check_host("anything.example")
    Gate("0.0.0.0", (), ()).check_host("10.0.0.5:8000")  # not on loopback: any name, unless a list is given
    assert _refused(Gate("0.0.0.0", ("api.example",), ()).check_host, "10.0.0.5:8000").code == "host_not_allowed"


def test_an_origin_must_be_the_apis_own_or_allowed():
    gate = Gate("127.0.0.1", (), ("http://app.example",))
    gate.check_origin(None, "127.0.0.1:8000")  # not a browser
    gate.check_origin("http://127.0.0.1:8000", "127.0.0.1:8000")
    gate.check_origin("http://app.example/", "127.0.0.1:8000")
    for origin in ("http://evil.example", "null", "https://127.0.0.1:8000", "http://127.0.0.1:9000"):
        err = _refused(gate.check_origin, origin, "127.0.0.1:8000")
        assert (err.status, err.code) == (403, "origin_not_allowed")
    Gate("127.0.0.1", (), ("*",)).check_origin("http://evil.example", "127.0.0.1:8000")


def test_post_bodies_must_be_json():
    check_content_type("application/json")
    check_content_type("Application/JSON; charset=utf-8")
    for value in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
        assert _refused(check_content_type, value).status == 415


def test_one_clients_slots():
    slots = ClientSlots(2)
    a1, a2 = slots.acquire("a"), slots.acquire("a")
    err = _refused(slots.acquire, "a")
    assert (err.status, err.type, err.code) == (429, "rate_limit_error", "too_many_requests")
    slots.acquire("b")  # another client is not held back
    a1()
    a1()  # releasing twice frees one slot, once
    slots.acquire("a")
    _refused(slots.acquire, "a")
    a2()
    unlimited = ClientSlots(0)
    for _ in range(100):
        unlimited.acquire("a")


def test_a_busy_port_is_a_one_line_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SangamaError, match=f"^port {port} on 127.0.0.1 is in use$"):
            check_port("127.0.0.1", port)
    check_port("127.0.0.1", 0)


def test_a_keyless_api_off_loopback_is_warned_about(caplog, tmp_path):
    key = tmp_path / "key"
    key.write_text("k")
    with caplog.at_level(logging.WARNING, logger="sangama_p2p.api.server"):
        for config in (ApiConfig(), ApiConfig(host="0.0.0.0", api_key_file=key), ApiConfig(host="::1")):
            ApiServer([], lambda m: None, config)
        assert not caplog.records
        ApiServer([], lambda m: None, ApiConfig(host="0.0.0.0"))
    assert len(caplog.records) == 1 and "0.0.0.0" in caplog.text and "no API key" in caplog.text
