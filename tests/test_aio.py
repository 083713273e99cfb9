"""``sangama_p2p.aio.Peer`` inside ``asyncio.run``: a generation completes with the one-process chain's tokens,
streaming works, asyncio keeps running meanwhile, and lifetimes and errors behave."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from sangama_p2p import aio
from sangama_p2p.cli.local_fleet import ThreadFleet
from sangama_p2p.client.config import ClientConfig
from sangama_p2p.errors import SangamaError
from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.model.spec import LayerRange
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.peer import PeerConfig

PROMPT = [3, 14, 159, 26, 53]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("aio")
    model = make_model(work / "aio-tiny", "qwen3_5_moe", "tiny")
    with ThreadFleet(model, [(0, 4), (4, 8)], work) as f:
        yield model, f
    torch.set_num_threads(before)


def client_config(model: Path, boot: str) -> PeerConfig:
    return PeerConfig(host=HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(boot,),
                                      dht_server=False),
                      client=ClientConfig(model_id=model.name), tokenizer_path=model)


def test_generate_and_stream_inside_asyncio_run(fleet) -> None:
    model, f = fleet
    ckpt = open_checkpoint(model)
    expected = LocalChain.load(ckpt, [LayerRange(0, 8)]).generate(PROMPT, 10, stop_at_eos=False).tokens

    async def main() -> dict:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        async with aio.Peer(client_config(model, f.bootstrap_addr), key_pair=generate_key_pair()) as peer:
            assert peer.peer_id.startswith("12D3KooW") and peer.addrs
            ticks_before = ticks
            g = await peer.generate(PROMPT, 10, stop_at_eos=False)
            ticks_during = ticks - ticks_before
            streamed = [t async for t in peer.stream(PROMPT, 10, stop_at_eos=False)]
            both = await asyncio.gather(peer.generate(PROMPT, 10, stop_at_eos=False),
                                        peer.generate(PROMPT, 10, guesses=2, stop_at_eos=False))
            text = (await peer.generate("hello", 4, stop_at_eos=False)).text
        tick_task.cancel()
        return {"tokens": list(g.tokens), "stream": streamed, "ticks": ticks_during,
                "both": [list(x.tokens) for x in both], "text": text}

    out = asyncio.run(main())
    assert out["tokens"] == expected
    assert out["stream"] == expected
    assert out["both"] == [expected, expected]  # guesses never change greedy tokens
    assert isinstance(out["text"], str)
    assert out["ticks"] > 0  # the asyncio loop kept running while trio worked


def test_early_stop_of_a_stream_and_errors(fleet) -> None:
    model, f = fleet

    async def main() -> None:
        peer = aio.Peer(client_config(model, f.bootstrap_addr), key_pair=generate_key_pair())
        with pytest.raises(SangamaError, match="not running"):
            await peer.generate(PROMPT, 2)
        async with peer:
            got = []
            async for t in peer.stream(PROMPT, 50, stop_at_eos=False):
                got.append(t)
                if len(got) == 3:
                    break  # the generation on the trio side is cancelled
            assert len(got) == 3
            with pytest.raises(SangamaError):  # a model nobody serves: the trio side's typed error arrives here
                await peer.generate(PROMPT, 2, model_id="nobody-serves-this")
            with pytest.raises(SangamaError, match="one aio.Peer per event loop thread"):
                async with aio.Peer(client_config(model, f.bootstrap_addr), key_pair=generate_key_pair()):
                    pass
            assert len((await peer.generate(PROMPT, 3, stop_at_eos=False)).tokens) == 3  # still healthy
        await peer.aclose()  # idempotent
        with pytest.raises(SangamaError):
            await peer.generate(PROMPT, 2)

    asyncio.run(main())


def test_cancelling_the_awaiting_task_cancels_the_generation(fleet) -> None:
    model, f = fleet

    async def main() -> int:
        async with aio.Peer(client_config(model, f.bootstrap_addr), key_pair=generate_key_pair()) as peer:
            task = asyncio.create_task(peer.generate(PROMPT, 400, stop_at_eos=False))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return len((await peer.generate(PROMPT, 2, stop_at_eos=False)).tokens)

    assert asyncio.run(main()) == 2


def test_the_http_api_inside_asyncio_run(fleet) -> None:
    """hypercorn's trio worker runs in the trio guest of an asyncio program; an asyncio HTTP client reaches it."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("hypercorn")
    from sangama_p2p.api import ApiConfig

    model, f = fleet
    ckpt = open_checkpoint(model)
    expected = LocalChain.load(ckpt, [LayerRange(0, 8)]).generate(PROMPT, 6).tokens

    async def main() -> tuple[list, dict]:
        async with aio.Peer(client_config(model, f.bootstrap_addr), key_pair=generate_key_pair()) as peer:
            url = await peer.serve_api(model, ApiConfig(port=0))
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                models = (await http.get("/v1/models")).json()
                res = await http.post("/v1/completions", json={"model": model.name, "prompt": PROMPT,
                                                               "max_tokens": 6, "temperature": 0})
        return models["data"], res.json()

    models, res = asyncio.run(main())
    assert [m["id"] for m in models] == [model.name]
    assert res["choices"][0]["token_ids"] == expected
