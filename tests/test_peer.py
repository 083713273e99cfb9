"""The trio ``Peer``: serving (fixed and auto ranges), generating and streaming through real stage peers on
loopback in this process, with tokens equal to the one-process chain; lifetimes and typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from sangama_p2p import Peer, PeerConfig
from sangama_p2p.client.config import ClientConfig
from sangama_p2p.errors import ModelError, RouteError, SangamaError, StageError
from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.model.spec import LayerRange
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.discovery import find_serving_peers

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
SCHEMA = {"type": "object", "properties": {"id": {"enum": [1, 2, 3]}}, "required": ["id"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("peer") / "peer-tiny", "qwen3_5_moe", "tiny")


@pytest.fixture(autouse=True)
def one_thread():
    """Several stages in one process each run torch off the trio thread: one intra-op thread avoids contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def local_tokens(model: Path, prompt: list[int], n: int, guesses: int | str = 0) -> list[int]:
    ckpt = open_checkpoint(model)
    chain = LocalChain.load(ckpt, [LayerRange(0, ckpt.spec.num_layers)])
    return chain.generate(prompt, n, guesses=guesses, stop_at_eos=False).tokens


def host(tmp: Path, name: str, boot: tuple[str, ...] = (), **kw) -> HostConfig:
    return HostConfig(listen_addrs=LOOPBACK, bootstrap_addrs=boot, key_path=tmp / f"{name}.key", **kw)


def test_serve_auto_generate_and_stream_equal_local(tiny: Path, tmp_path: Path) -> None:
    prompt = [5, 17, 300, 42, 7]
    expected = local_tokens(tiny, prompt, 12)
    expected_guess = local_tokens(tiny, prompt, 12, guesses=2)
    seen: dict = {}

    async def main() -> None:
        async with Peer(PeerConfig(host=host(tmp_path, "a"))) as a:
            assert await a.serve(tiny, "0:3") == (0, 3)
            boot = (a.addrs[0],)
            async with Peer(PeerConfig(host=host(tmp_path, "b", boot))) as b:
                seen["b"] = await b.serve(tiny, "auto")  # a third of 8 layers, where nobody serves: 3:6
                async with Peer(PeerConfig(host=host(tmp_path, "c", boot))) as c:
                    seen["c"] = await c.serve(tiny, "auto:2")  # the rest
                    config = PeerConfig(host=host(tmp_path, "d", boot, dht_server=False),
                                        client=ClientConfig(model_id="peer-tiny"), tokenizer_path=tiny)
                    async with Peer(config) as d:
                        g = await d.generate(prompt, 12, stop_at_eos=False)
                        seen["generate"] = list(g.tokens)
                        seen["text"] = g.text
                        seen["route"] = g.result.route
                        seen["guess"] = list((await d.generate(prompt, 12, guesses=2, stop_at_eos=False)).tokens)
                        seen["stream"] = [t async for t in d.stream(prompt, 12, stop_at_eos=False)]
                        seen["text_prompt"] = len((await d.generate("def f(", 3, stop_at_eos=False)).tokens)
                        held = await d.generate(prompt, 40, guesses=2, json_schema=SCHEMA)
                        seen["json"] = d.tokenizer.decode([t for t in held.tokens if t not in (0,)])  # eos: 0
                        seen["json_end"] = held.tokens[-1]
                    # a bare model id names no checkpoint: in a public swarm an embedded client is refused (issue 26)
                    bare = PeerConfig(host=host(tmp_path, "e", boot, dht_server=False),
                                      client=ClientConfig(model_id="peer-tiny"))
                    async with Peer(bare) as e:
                        with pytest.raises(RouteError, match=r"does not name a checkpoint.*PeerConfig\(tokenizer_path"):
                            await e.generate(prompt, 2, stop_at_eos=False)
                    # a serving peer generates through a chain that includes its own stage (in-process stream)
                    own = await b.generate(prompt, 12, stop_at_eos=False)
                    seen["own"], seen["own_route"] = list(own.tokens), own.result.route
            assert a.servers[0].config.model_id == "peer-tiny"

    trio.run(main)
    assert seen["b"] == (3, 6) and seen["c"] == (6, 8)
    assert seen["generate"] == expected
    assert seen["guess"] == expected_guess
    assert seen["stream"] == expected
    assert seen["text"] == open_checkpoint(tiny).tokenizer.decode(expected)
    assert len(seen["route"]) == 3
    assert seen["text_prompt"] == 3
    value = json.loads(seen["json"])  # the made model's random weights, held to the schema
    assert set(value) == {"id"} and value["id"] in (1, 2, 3) and seen["json_end"] == 0, seen["json"]
    assert seen["own"] == expected and len(seen["own_route"]) == 3


def test_auto_and_own_chains_ignore_another_checkpoint_under_the_same_id(tiny: Path, tmp_path: Path) -> None:
    other = make_model(tmp_path / "peer-tiny", "qwen3_5_moe", "tiny", seed=1)  # same name, other weights
    prompt = [5, 17, 300, 42, 7]
    expected = local_tokens(tiny, prompt, 6)
    seen: dict = {}

    async def main() -> None:
        async with Peer(PeerConfig(host=host(tmp_path, "a"))) as a:
            assert await a.serve(other, "0:3") == (0, 3)
            async with Peer(PeerConfig(host=host(tmp_path, "b", (a.addrs[0],)))) as b:
                seen["b"] = await b.serve(tiny, "auto:8")  # a's 0:3 is another checkpoint: nothing is served yet
                g = await b.generate(prompt, 6, stop_at_eos=False)
                client = await b.client()
                seen.update(tokens=list(g.tokens), route=g.result.route, pinned=client.config.fingerprint,
                            mine=b.servers[0].identity.fingerprint, theirs=a.servers[0].identity.fingerprint,
                            left=dict(client.left_out), a=a.peer_id, b_id=b.peer_id)

    trio.run(main)
    assert seen["b"] == (0, 8)
    assert seen["mine"] != seen["theirs"] and seen["pinned"] == seen["mine"]
    assert seen["tokens"] == expected and seen["route"] == [seen["b_id"]]
    assert set(seen["left"]) == {seen["a"]} and "differs from the local checkpoint" in seen["left"][seen["a"]].reason


def test_auto_at_join_sees_the_gap_a_departed_peer_left_while_its_record_lives_on(tiny: Path, tmp_path: Path) -> None:
    """The only 3:6 peer leaves; its record stays in the DHT up to its TTL (180 s). A peer joining with ``auto`` right
    after asks the recorded peers what they serve (as the rebalancer does) and takes the gap, 3:6; before, it counted
    the departed peer's record and took a spare elsewhere (the lab's churn run: the range that was left stayed empty
    until a spare moved)."""
    seen: dict = {}

    async def main() -> None:
        async with Peer(PeerConfig(host=host(tmp_path, "a"))) as a:
            assert await a.serve(tiny, "0:3") == (0, 3)
            boot = (a.addrs[0],)
            async with Peer(PeerConfig(host=host(tmp_path, "c", boot))) as c:
                assert await c.serve(tiny, "6:8") == (6, 8)
                async with Peer(PeerConfig(host=host(tmp_path, "b", boot))) as b:
                    assert await b.serve(tiny, "3:6") == (3, 6)
                    seen["b"] = b.peer_id
                async with Peer(PeerConfig(host=host(tmp_path, "d", boot))) as d:  # b's record is still there
                    records = await find_serving_peers(d.node, "peer-tiny", include_self=False)
                    seen["recorded"] = sorted((r.start, r.end) for r in records)
                    seen["d"] = await d.serve(tiny, "auto")

    trio.run(main)
    assert seen["recorded"] == [(0, 3), (3, 6), (6, 8)]  # the departed peer's record lives on
    assert seen["d"] == (3, 6)


def test_config_with_model_serves_on_start(tiny: Path, tmp_path: Path) -> None:
    async def main() -> tuple[int, int, str]:
        config = PeerConfig(host=host(tmp_path, "s"), model_path=tiny, layers="2:5")
        async with Peer(config) as p:
            s = p.servers[0].config
            assert p.tokenizer is not None  # the served checkpoint's tokenizer takes text prompts
            from rich.console import Console

            from sangama_p2p.cli.peer_cmds import _panel

            console = Console(record=True, width=120)
            console.print(_panel(p))  # join's live panel, from a real server's figures
            text = console.export_text()
            assert "peer-tiny" in text and "2:5" in text
            assert p.servers[0].identity.fingerprint[:12] in text  # which checkpoint this peer serves
            with pytest.raises(StageError, match="already serves peer-tiny 2:5"):
                await p.serve(tiny, "5:8")  # one stage per peer: a second would take the first one's streams
            assert len(p.servers) == 1
            return s.start, s.end, s.model_id

    assert trio.run(main) == (2, 5, "peer-tiny")


def test_errors_are_typed(tiny: Path, tmp_path: Path) -> None:
    async def main() -> None:
        p = Peer(PeerConfig(host=host(tmp_path, "e")))
        with pytest.raises(SangamaError, match="not running"):
            await p.generate([1, 2], 2, model_id="x")
        with pytest.raises(SangamaError, match="not running"):
            _ = p.peer_id
        async with p:
            with pytest.raises(ModelError, match="tokenizer"):
                await p.generate("text needs a tokenizer", 2, model_id="x")
            with pytest.raises(ModelError, match="which model"):
                await p.generate([1, 2], 2)
            with pytest.raises(SangamaError):
                await p.serve(tiny, "6:99")  # outside the model
            assert p.servers == []
        await p.aclose()  # idempotent
        with pytest.raises(SangamaError, match="not running"):
            await p.serve(tiny, "0:2")

    trio.run(main)


def test_a_client_peer_takes_its_tokenizer_from_a_gguf_file(tiny: Path, tmp_path: Path) -> None:
    """``tokenizer_path`` may name a ``.gguf`` file (the demo and benchmarks pass the model they run): its embedded
    tokenizer and end-of-sequence id, as the checkpoint's own, with no tensor read."""
    from sangama_p2p.model.gguf import write_gguf

    (gguf,) = write_gguf(tiny, tmp_path / "tiny.gguf", "Q8_0")
    ref = open_checkpoint(tiny).tokenizer
    seen: dict = {}

    async def main() -> None:
        config = PeerConfig(host=host(tmp_path, "c"), client=ClientConfig(model_id="tiny"), tokenizer_path=gguf)
        async with Peer(config) as c:
            seen["ids"] = c.encode("def fibonacci(n):")
            seen["text"] = c.tokenizer.decode(seen["ids"])

    trio.run(main)
    assert seen["ids"] == ref.encode("def fibonacci(n):")
    assert seen["text"] == "def fibonacci(n):"


def test_a_serving_only_peer_keeps_no_tokenizer(tiny: Path, tmp_path: Path) -> None:
    """``serve(..., tokenizer=False)`` (what ``join`` does) builds no tokenizer: text prompts are then a typed error,
    token ids still work; by default the served model's tokenizer is kept for the peer's own prompts."""
    seen: dict = {}

    async def main() -> None:
        async with Peer(PeerConfig(host=host(tmp_path, "s"))) as s:
            await s.serve(tiny, "0:8", tokenizer=False)
            seen["bare"] = s.tokenizer
            with pytest.raises(ModelError, match="need a tokenizer"):
                s.encode("hello")
            seen["ids"] = s.encode([1, 2, 3])
        async with Peer(PeerConfig(host=host(tmp_path, "t"))) as t:
            await t.serve(tiny, "0:8")
            seen["kept"] = t.tokenizer

    trio.run(main)
    assert seen["bare"] is None and seen["ids"] == [1, 2, 3]
    assert seen["kept"] is not None and seen["kept"].encode("hello") == open_checkpoint(tiny).tokenizer.encode("hello")
