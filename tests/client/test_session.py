"""The client's checks of a last stage's answer (pure)."""

from __future__ import annotations

import pytest

from sangama_p2p.client.session import ChainBroken, check_result
from sangama_p2p.wire.messages import StepResult

SID = bytes(16)


def test_accepted_tokens_must_be_a_prefix_of_the_guesses_plus_one():
    sent = [5, 7, 8, 9]  # last token + 3 guesses
    for tokens in [(1,), (7, 1), (7, 8, 2), (7, 8, 9, 3)]:
        check_result(StepResult(SID, 1, tokens, (), ()), sent, 3, "p")
    for tokens in [(), (8, 1), (7, 9, 1), (7, 8, 9, 3, 4)]:
        with pytest.raises(ChainBroken) as info:
            check_result(StepResult(SID, 1, tokens, (), ()), sent, 3, "p")
        assert info.value.misbehaving == {"p"}
    check_result(StepResult(SID, 0, (4,), (), ()), [1, 2, 3], 0, "p")  # a prefill checks no guess
    with pytest.raises(ChainBroken):
        check_result(StepResult(SID, 0, (4, 5), (), ()), [1, 2, 3], 0, "p")


@pytest.mark.parametrize("code", ["INTERNAL", "OVERLOADED", "EXPIRED"])
def test_a_stage_error_that_another_chain_may_not_have_breaks_the_chain(code: str):
    from types import SimpleNamespace

    from sangama_p2p.client.session import ChainSession
    from sangama_p2p.errors import ErrorCode, StageRefused
    from sangama_p2p.wire.messages import ErrorMessage

    session = SimpleNamespace(peers=["a", "b"])
    with pytest.raises(ChainBroken, match=code):  # the transport probes, re-routes and replays
        ChainSession._fail(session, "b", ErrorMessage(SID, 3, ErrorCode[code], "next hop c"))
    with pytest.raises(StageRefused):  # a refusal of the request itself is the caller's to judge
        ChainSession._fail(session, "b", ErrorMessage(SID, 3, ErrorCode.CAPACITY, "full"))
