"""AutoNAT v1 (``/libp2p/autonat/1.0.0``), the asking side: reachability from a node that does not run Sangama.

A bootstrap or relay node of another implementation (go-libp2p's daemon ``p2pd``, say) does not speak our
``/sangama/dialback/1`` (net/reach.py), so a peer whose only servers are such nodes never learned its reachability.
Many of them answer the standard AutoNAT v1 instead: one DIAL message with our peer id and addresses, one
DIAL_RESPONSE with a status. go-libp2p's server dials back from a separate host (a fresh connection, as ours does) and
only at the requester's observed IP; it refuses (``E_DIAL_REFUSED``) addresses that are not public, so inside a lab of
private addresses it never decides, and that counts as no answer (:func:`~.reach.check_reachability` then acts on
its own safe choice).

py-libp2p 0.8.1 has an AutoNAT service, but its server answers through the connection the asker already holds (every
asker is told it is reachable) and its client needs four agreeing servers; we use its message type only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from ..errors import NetworkError, translate

__all__ = ["AUTONAT_PROTOCOL", "AutoNatAnswer", "ask_autonat"]

AUTONAT_PROTOCOL = TProtocol("/libp2p/autonat/1.0.0")
MAX_MESSAGE = 4096  # a DIAL_RESPONSE is a status, a short text and one address
MAX_ADDRS = 8


@dataclass(frozen=True)
class AutoNatAnswer:
    """What an AutoNAT server said: ``reached`` (the address it dialled us at), ``unreachable`` (it tried and failed),
    or neither (it refused or could not try: no verdict)."""

    status: int
    text: str = ""
    addr: str = ""

    @property
    def reached(self) -> bool:
        return self.status == Message.OK

    @property
    def unreachable(self) -> bool:
        return self.status == Message.E_DIAL_ERROR


def dial_request(peer_id: ID, addrs: Sequence[str]) -> bytes:
    """The DIAL message for ``peer_id`` at ``addrs`` (at most ``MAX_ADDRS``; circuit addresses left out)."""
    request = Message(type=Message.DIAL)
    request.dial.peer.id = peer_id.to_bytes()
    for addr in [a for a in addrs if "/p2p-circuit" not in a][:MAX_ADDRS]:
        request.dial.peer.addrs.append(Multiaddr(addr).to_bytes())
    return encode_varint_prefixed(request.SerializeToString())


def parse_response(data: bytes) -> AutoNatAnswer:
    """A DIAL_RESPONSE's status, text and address; :class:`NetworkError` if the bytes are not one."""
    try:
        message = Message()
        message.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise translate(exc, NetworkError, "AutoNAT answer is not a protobuf message")
    if message.type != Message.DIAL_RESPONSE or not message.HasField("dialResponse"):
        raise NetworkError("AutoNAT answer is not a DIAL_RESPONSE")
    response = message.dialResponse
    addr = ""
    if response.HasField("addr"):
        try:
            addr = str(Multiaddr(bytes(response.addr)))
        except Exception:  # a bad address does not change the verdict
            addr = ""
    return AutoNatAnswer(int(response.status), str(response.statusText)[:200], addr)


async def ask_autonat(host: IHost, server: ID, addrs: Sequence[str], timeout_s: float = 10.0) -> AutoNatAnswer:
    """Ask ``server`` (already connected) to dial us back at ``addrs``; :class:`NetworkError` if it does not answer."""
    try:
        with trio.fail_after(timeout_s):
            stream = await host.new_stream(server, [AUTONAT_PROTOCOL])
            try:
                await stream.write(dial_request(host.get_id(), addrs))
                data = await read_varint_prefixed_bytes_limited(stream, MAX_MESSAGE)
            finally:
                await stream.close()
    except trio.TooSlowError as exc:
        raise NetworkError(f"AutoNAT server {server} did not answer within {timeout_s:g} s") from exc
    except NetworkError:
        raise
    except Exception as exc:  # stream, negotiation and varint errors of one peer
        raise translate(exc, NetworkError, f"AutoNAT request to {server} failed")
    return parse_response(data)
