"""The public surface of ``sangama_p2p`` is pinned (as trio's ``test_exports`` pins trio's).

Adding a name is a decision: update ``PUBLIC`` in the same commit. Importing the package must stay light: a
bootstrap node imports it and must not load torch; ``wire/`` users must not load trio or libp2p.
"""

from __future__ import annotations

import subprocess
import sys

import sangama_p2p

PUBLIC = {
    "CapacityError", "CheckpointError", "ErrorCode", "LayerRangeError", "ModelError", "NetworkError", "Peer",
    "PeerConfig", "RouteError", "SangamaError", "SessionStateError", "StageError", "UnsupportedModelError",
    "WireError", "__version__",
}  # fmt: skip


def test_all_is_pinned() -> None:
    assert set(sangama_p2p.__all__) == PUBLIC
    assert len(sangama_p2p.__all__) == len(PUBLIC)  # no duplicates


def test_every_public_name_resolves() -> None:
    for name in sangama_p2p.__all__:
        assert getattr(sangama_p2p, name) is not None, name
    from sangama_p2p import aio
    from sangama_p2p.peer import Peer, PeerConfig

    assert sangama_p2p.Peer is Peer and sangama_p2p.PeerConfig is PeerConfig
    assert aio.Peer is not Peer  # the asyncio face is its own class over the trio core
    assert "Peer" in dir(sangama_p2p)


def test_unknown_attribute_raises() -> None:
    try:
        sangama_p2p.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_package_import_is_light() -> None:
    script = (
        "import sys, sangama_p2p\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'trio', 'libp2p'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
