"""wire/ is bytes only: importing it must not pull in torch, trio or libp2p; its public surface is pinned."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import sangama_p2p.wire as wire

PUBLIC = {
    "DEFAULT_MAX_FRAME", "DTYPE_SIZES", "INFO_PROTOCOL", "LANE_PROTOCOL", "STAGE_PROTOCOL", "WIRE_VERSION", "CloseSession",
    "ErrorMessage", "FrameDecoder", "FrameReader", "InfoRequest", "InfoResponse", "LaneOffer", "Message", "OpenSession",
    "SessionOpened", "Step", "StepResult", "Tensor", "TokenLogprobs", "TraceStamp", "decode", "encode", "encode_frame",
    "encode_message_frame", "read_exactly", "read_frame",
}  # fmt: skip


def test_wire_imports_no_torch_trio_or_libp2p() -> None:
    modules = [f"sangama_p2p.wire.{m.name}" for m in pkgutil.iter_modules(wire.__path__)]
    assert "sangama_p2p.wire.codec" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'trio', 'libp2p', 'numpy'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_public_surface_is_pinned() -> None:
    assert set(wire.__all__) == PUBLIC
    for name in wire.__all__:
        assert getattr(wire, name) is not None
