"""Cost of the wire codec per message: encode, decode, and the full path (frame, incremental decoder, decode).

    python benchmarks/wire_codec.py [--seconds 0.3]

Goal: a Step carrying an 8 KiB bf16 hidden state encodes + decodes in well under 50 us. Prints a table and writes
benchmarks/results/wire_codec.json. Pure Python bytes work: no torch, no network.

Large payloads: alternating 1 MiB allocations make glibc hand memory back to the OS and fault it in again, so the
1 MiB "enc+dec" row costs ~10x encode + decode (1178 us vs 127 us measured with
``MALLOC_MMAP_THRESHOLD_=100000000 MALLOC_TRIM_THRESHOLD_=100000000``): an allocator effect a peer process can tune,
not codec work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from sangama_p2p.errors import ErrorCode
from sangama_p2p.wire import (
    ErrorMessage,
    FrameDecoder,
    Message,
    Step,
    StepResult,
    Tensor,
    TraceStamp,
    decode,
    encode,
    encode_message_frame,
)

SID = bytes(range(16))
TRACE = tuple(TraceStamp(f"12D3KooWPeer{i}", 10**12 + i, 10**12 + 5, 10**12 + 9, 10**12 + 10, 4) for i in range(3))


def cases() -> dict[str, Message]:
    hidden_8k = Tensor("bf16", (1, 4096), bytes(8192))
    hidden_1m = Tensor("bf16", (128, 4096), bytes(128 * 4096 * 2))
    return {
        "Step tokens (8 ids, first stage)": Step(SID, 7, 100, tuple(range(1000, 1008)), None, (1, 2, 3), ()),
        "Step hidden 8 KiB bf16 + 3 stamps": Step(SID, 7, 100, (), hidden_8k, (1, 2, 3, 4), TRACE),
        "Step hidden 1 MiB bf16 (prefill)": Step(SID, 0, 0, (), hidden_1m, (), TRACE[:1]),
        "StepResult 3+1 tokens + 3 stamps": StepResult(SID, 7, (1, 2, 3, 4), (5, 6, 7, 8), TRACE),
        "ErrorMessage": ErrorMessage(SID, 7, ErrorCode.BAD_POSITION, "start position ahead of cache"),
    }


def per_call_us(fn: Callable[[], object], seconds: float) -> float:
    """Median over 5 rounds of the CPU time per call (process time: steadier than wall time on a shared machine;
    for this single-threaded code the two agree on an idle one)."""
    n, t = 1, 0.0
    while t < 0.01:
        t0 = time.process_time()
        for _ in range(n):
            fn()
        t = time.process_time() - t0
        n *= 2
    reps = max(1, int(n / 2 * (seconds / 5) / t))
    rounds = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        rounds.append((time.process_time() - t0) / reps * 1e6)
    return statistics.median(rounds)


def full_path(msg: Message) -> Callable[[], object]:
    dec = FrameDecoder()

    def run() -> object:
        (payload,) = dec.feed(encode_message_frame(msg))
        return decode(payload)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    args = ap.parse_args()
    rows = []
    print("CPU microseconds per call (median of 5 rounds)")
    print(f"{'message':36} {'bytes':>9} {'encode us':>10} {'decode us':>10} {'enc+dec us':>11} {'framed us':>10}")
    for name, msg in cases().items():
        payload = encode(msg)
        assert decode(payload) == msg
        row = {
            "message": name,
            "payload_bytes": len(payload),
            "encode_us": per_call_us(lambda m=msg: encode(m), args.seconds),
            "decode_us": per_call_us(lambda p=payload: decode(p), args.seconds),
            "encode_decode_us": per_call_us(lambda m=msg: decode(encode(m)), args.seconds),
            "framed_round_trip_us": per_call_us(full_path(msg), args.seconds),
        }
        rows.append(row)
        print(
            f"{name:36} {len(payload):9d} {row['encode_us']:10.2f} {row['decode_us']:10.2f} "
            f"{row['encode_decode_us']:11.2f} {row['framed_round_trip_us']:10.2f}",
            flush=True,
        )
    out = Path(__file__).parent / "results" / "wire_codec.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "seconds": args.seconds,
        "clock": "process_time",
        "load_avg_1m": os.getloadavg()[0],
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
