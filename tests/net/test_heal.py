"""Issue 27 on loopback: a relay or bootstrap node that restarts (same key, same port) is found again by the peers that
were using it, without restarting them. The real processes behind NATs are in ``test_heal_netns.py``."""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import trio
from libp2p.crypto.keys import KeyPair

from sangama_p2p.net.discovery import Announcer, ServingOffer
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.node import Node
from sangama_p2p.net.directory import directory_key
from sangama_p2p.net.records import provider_key
from sangama_p2p.net.relay import RelayServiceConfig
from sangama_p2p.net.traversal import Traversal, TraversalConfig

from .net_swarm import config, first_addr

FP = "0" * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(key: KeyPair, port: int, relay: bool, stop: trio.Event, stopped: trio.Event, *,
                 task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
    """The bootstrap (and relay) node on ``port`` with ``key`` (the same address and id each time it starts), until
    ``stop`` is set. A task of its own: it stops while the nodes started after it still run."""
    services = []
    traversal = Traversal(TraversalConfig(relay_limits=RelayServiceConfig()))
    if relay:
        services.append(traversal.run)
    cfg = config(listen_addrs=(f"/ip4/127.0.0.1/tcp/{port}",), relay_hop=relay)
    try:
        async with open_host(cfg, key_pair=key, services=services) as node:
            if relay:
                with trio.fail_after(10):
                    await traversal.wait_ready()
            task_status.started(node)
            await stop.wait()
    finally:
        stopped.set()


async def _start(nursery: trio.Nursery, key: KeyPair, port: int, *, relay: bool) -> tuple[Node, Callable[[], Awaitable[None]]]:
    """Start the node in ``nursery``; returns it and an async function that stops it (its port free again)."""
    stop, stopped = trio.Event(), trio.Event()
    node = await nursery.start(_serve, key, port, relay, stop, stopped)

    async def close() -> None:
        stop.set()
        await stopped.wait()

    return node, close


async def _wait(predicate, timeout: float, step: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``predicate()`` (sync or async) is true; fails after ``timeout``."""
    t0 = trio.current_time()
    with trio.fail_after(timeout):
        while True:
            got = predicate()
            if hasattr(got, "__await__"):
                got = await got
            if got:
                return trio.current_time() - t0
            await trio.sleep(step)


def test_a_restarted_relay_holds_the_reservation_again_within_seconds_and_the_circuit_address_follows() -> None:
    """Old code: the keeper slept for 3/4 of the reservation's hour after the grant, so the private peer kept
    advertising the circuit while the relay was away, and the restarted relay refused every circuit to it
    (NO_RESERVATION) for 45 minutes."""

    async def main() -> None:
        key, port = generate_key_pair(), _free_port()
        async with AsyncExitStack() as outer:
            nursery = await outer.enter_async_context(trio.open_nursery())
            relay, stop = await _start(nursery, key, port, relay=True)
            relay_addr = first_addr(relay)
            b_t = Traversal(TraversalConfig(reachability="private", hole_punch=False))
            b = await outer.enter_async_context(
                open_host(config(bootstrap_addrs=(relay_addr,)), services=[b_t.run]))
            with trio.fail_after(15):
                await b_t.wait_ready()
            seen: list[list[str]] = []  # the circuit addresses each time the traversal told its listeners
            b_t.listeners.append(lambda: seen.append([str(a) for a in b_t.circuit_addrs()]))
            circuits = [str(a) for a in b_t.circuit_addrs()]
            assert circuits
            a_t = Traversal(TraversalConfig(reachability="public", hole_punch=False))
            a = await outer.enter_async_context(open_host(config(), services=[a_t.run]))

            await stop()  # the relay goes away: its connections close
            gone = await _wait(lambda: not b_t.circuit_addrs(), 5.0)  # nobody can reach B there: not advertised
            t_restart = trio.current_time()
            _, stop = await _start(nursery, key, port, relay=True)

            async def through_relay() -> bool:
                for conn in a.connections(b.peer_id):
                    await conn.close()
                try:
                    await a_t.connect(b.peer_id, circuits)
                    return True
                except Exception:  # NO_RESERVATION until B reserved again
                    return False

            took = await _wait(through_relay, 10.0, step=0.2)
            print(f"\nrelay stopped: B's circuit address withdrawn after {gone:.2f} s; relay restarted: B reachable "
                  f"through it again {trio.current_time() - t_restart:.2f} s after the restart ({took:.2f} s of polling)")
            assert b_t.relay_client is not None and b_t.relay_client.keeper.regained >= 1
            # the lost reservation left B's advertised addresses (a re-publish), and the regained one came back
            assert seen[0] == [] and seen[-1] == circuits, seen
            assert [str(x) for x in b.extra_addrs] == circuits
            await stop()

    trio.run(main)


def test_a_restarted_bootstrap_holds_the_records_and_providers_again_within_seconds() -> None:
    """(The record is held in its range's directory.) Old code: nothing reconnected to the bootstrap node, and the dial
    that failed while it was away dropped it from
    the routing table: its store stayed empty until the next periodic re-publish (60 s here), which reached nobody
    when the routing table had nobody else."""

    async def main() -> None:
        key, port = generate_key_pair(), _free_port()
        async with AsyncExitStack() as outer:
            nursery = await outer.enter_async_context(trio.open_nursery())
            boot, stop = await _start(nursery, key, port, relay=False)
            boot_addr = first_addr(boot)
            stage = await outer.enter_async_context(open_host(config(bootstrap_addrs=(boot_addr,))))
            announcer = Announcer(stage)
            offer = ServingOffer("tiny", 0, 4, fingerprint=FP, num_layers=8)  # 180 s: re-published every 60 s
            await announcer.update(offer)
            stage.nursery.start_soon(announcer.run)
            rkey = directory_key("tiny", 0).encode()  # the directory holding the stage's record
            pkey = bytes.fromhex(provider_key("tiny"))
            assert boot.dht is not None and boot.dht.value_store.get(rkey) is not None

            await stop()
            try:  # a lookup while the bootstrap is away fails its dial (and drops it from the routing table)
                await stage.connect(boot.peer_id)
            except Exception:
                pass
            t_restart = time.monotonic()
            back, stop = await _start(nursery, key, port, relay=False)
            assert back.dht is not None and back.dht.value_store.get(rkey) is None  # it forgot everything

            def holds() -> bool:
                return back.dht.value_store.get(rkey) is not None and any(  # type: ignore[union-attr]
                    p.peer_id == stage.peer_id for p in back.dht.provider_store.get_providers(pkey))

            await _wait(holds, 10.0)
            print(f"\nbootstrap restarted: it holds the stage's record and provider entry again "
                  f"{time.monotonic() - t_restart:.2f} s after the restart (re-publish period 60 s)")
            assert stage.dht is not None and back.peer_id in stage.dht.routing_table.get_peer_ids()
            await stop()

    trio.run(main)
