"""Multiaddrs as a node sees them: the order peers' addresses are dialled in, and what an address or a connection says
(relayed or not, wildcard, the far end's ip and port). Pure functions over py-libp2p's ``Multiaddr`` and connections.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import multiaddr
from libp2p.abc import INetConn

__all__ = ["is_relayed", "is_site_local", "is_wildcard", "order_addrs", "remote_addr", "source_keys", "stream_source",
           "strip_p2p"]

# Site-local ranges: dialled after public ones. Documentation and benchmark ranges (198.18/15, 203.0.113/24, ...)
# count as public on purpose: network-namespace tests use them as "the internet".
_LOCAL_NETS = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
)


def is_site_local(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A link-local or private-range address: reachable only inside its site (dialled after public ones)."""
    return ip.is_link_local or any(ip in net for net in _LOCAL_NETS if net.version == ip.version)


def order_addrs(addrs: Any) -> list[multiaddr.Multiaddr]:
    """Deduplicate, keeping the given order within each class: public, then private, then loopback, then relayed.

    The order a peer advertised is kept inside each class, so its announced public addresses stay first.
    """
    seen: set[str] = set()
    unique = []
    for addr in addrs:
        if str(addr) not in seen:
            seen.add(str(addr))
            unique.append(addr)
    return sorted(unique, key=_addr_rank)  # sorted() is stable


def _addr_rank(addr: multiaddr.Multiaddr) -> int:
    if is_relayed(addr):
        return 3
    for proto in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(addr.value_for_protocol(proto))
        except (LookupError, ValueError):  # no such protocol in the address (ProtocolLookupError), or not an IP
            continue
        if ip.is_loopback:
            return 2
        return 1 if is_site_local(ip) else 0
    return 0  # dns names: assume public


def is_relayed(addr: multiaddr.Multiaddr) -> bool:
    """True for ``/p2p-circuit`` addresses (reachable only through a relay)."""
    return "/p2p-circuit" in str(addr)


def remote_addr(conn: INetConn) -> tuple[str, int] | None:
    """The (ip, port) at the far end of a connection, or None for relayed/unknown ones."""
    muxed = getattr(conn, "muxed_conn", None)
    getter = getattr(muxed, "get_remote_address", None)
    return getter() if getter is not None else None


def strip_p2p(addr: multiaddr.Multiaddr) -> multiaddr.Multiaddr:
    addr = multiaddr.Multiaddr(str(addr))
    text = str(addr)
    if is_relayed(addr):
        return addr
    idx = text.rfind("/p2p/")
    return multiaddr.Multiaddr(text[:idx]) if idx > 0 else addr


def is_wildcard(addr: multiaddr.Multiaddr) -> bool:
    return "/ip4/0.0.0.0/" in str(addr) or "/ip6/::/" in str(addr)


def source_keys(ip: str | None) -> tuple[str, ...]:
    """What a stage counts a client's sessions under beside its peer id (keys are free, addresses are not): its
    address and its network, the /24 of an IPv4 address or the /64 of an IPv6 one. None for a loopback source (the
    stage's own machine) or an unknown one (a relayed connection does not show its client's address)."""
    if not ip:
        return ()
    try:
        addr: Any = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ()
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback or addr.is_unspecified:
        return ()
    net = ipaddress.ip_network(f"{addr}/{24 if addr.version == 4 else 64}", strict=False)
    return (f"address {addr}", f"network {net}")


def stream_source(stream: Any) -> tuple[str, ...]:
    """:func:`source_keys` of the far end of a libp2p stream or a lane (``get_remote_address``: (ip, port))."""
    getter = getattr(stream, "get_remote_address", None)
    try:
        remote = getter() if getter is not None else None
    except Exception:  # a stream whose connection is already gone: no address to count
        return ()
    return source_keys(remote[0]) if remote else ()
