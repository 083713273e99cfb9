"""One long-lived stream carries many sessions: frames interleave and are told apart by session_id alone."""

from __future__ import annotations

import itertools
import random

import trio
import trio.testing

from sangama_p2p.wire import FrameReader, Step, Tensor, decode, encode_message_frame

SESSIONS = [bytes([i]) * 16 for i in range(6)]
STEPS = 25


def step(sid: bytes, n: int) -> Step:
    hidden = Tensor("bf16", (n % 3 + 1, 64), bytes([n % 256]) * ((n % 3 + 1) * 128))
    return Step(sid, n, 10 + n, (), hidden, (n, n + 1), ())


def test_sessions_interleave_on_one_stream() -> None:
    async def main() -> None:
        send, recv = trio.testing.memory_stream_pair()
        write_lock = trio.Lock()  # whole frames only: one writer at a time, one write per frame
        received: dict[bytes, list[Step]] = {sid: [] for sid in SESSIONS}
        order: list[bytes] = []

        async def session_writer(sid: bytes, seed: int) -> None:
            rng = random.Random(seed)
            for n in range(STEPS):
                frame = encode_message_frame(step(sid, n))
                async with write_lock:
                    await send.send_all(frame)
                for _ in range(rng.randint(0, 3)):
                    await trio.lowlevel.checkpoint()

        async def reader() -> None:
            frames = FrameReader(recv.receive_some, chunk_size=333)  # reads cut across frame boundaries
            while (payload := await frames.next_frame()) is not None:
                msg = decode(payload)
                assert isinstance(msg, Step)
                received[msg.session_id].append(msg)
                order.append(msg.session_id)

        async with trio.open_nursery() as outer:
            outer.start_soon(reader)
            async with trio.open_nursery() as writers:
                for i, sid in enumerate(SESSIONS):
                    writers.start_soon(session_writer, sid, i)
            await send.aclose()

        switches = sum(a != b for a, b in itertools.pairwise(order))
        assert switches > 3 * len(SESSIONS)  # the sessions really did interleave
        for sid in SESSIONS:
            assert received[sid] == [step(sid, n) for n in range(STEPS)]

    trio.run(main)
