"""A next-hop link whose dial fails: the stage's sessions hear a typed error, ours unchanged, a foreign one named."""

from __future__ import annotations

import trio

from sangama_p2p.errors import NetworkError
from sangama_p2p.stage.links import Outbox


def _failure(exc: Exception) -> tuple[BaseException | None, list[BaseException]]:
    heard: list[BaseException] = []

    async def opener():
        raise exc

    async def main():
        with trio.fail_after(5):
            outbox = Outbox(peer="next", opener=opener, on_failed=lambda box, lost, e: heard.append(e))
            await outbox.run()
            return outbox.failed

    return trio.run(main), heard


def test_a_foreign_dial_error_fails_the_link_as_a_network_error_naming_it():
    refused = ConnectionRefusedError(111, "Connection refused")
    failed, heard = _failure(refused)
    assert type(failed) is NetworkError and heard == [failed]
    assert str(failed) == "opening or writing the stream: ConnectionRefusedError: [Errno 111] Connection refused"
    assert failed.__cause__ is refused  # it used to be the bare ConnectionRefusedError, untyped


def test_our_own_dial_error_reaches_the_sessions_as_it_was_raised():
    ours = NetworkError("next not reached in 5 s")
    failed, heard = _failure(ours)
    assert failed is ours and heard == [ours]
