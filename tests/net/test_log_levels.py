"""-v shows Sangama's INFO lines and libp2p's warnings; no -v shows neither libp2p noise nor our INFO (cli/process.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = ("import logging, sys; logging.basicConfig(level=int(sys.argv[1]))\n"
        "from sangama_p2p.cli.process import quiet_libp2p; quiet_libp2p()\n"
        "import libp2p.network.swarm as swarm\n"
        "swarm.logger.warning('LIBP2P-WARN'); swarm.logger.info('LIBP2P-INFO')\n"
        "logging.getLogger('sangama_p2p.net.dial').info('OUR-INFO')\n"
        "logging.getLogger('sangama_p2p.net.dial').warning('OUR-WARN')\n")


@pytest.mark.parametrize(("level", "shown", "hidden"), [
    (30, {"OUR-WARN"}, {"OUR-INFO", "LIBP2P-WARN", "LIBP2P-INFO"}),
    (20, {"OUR-WARN", "OUR-INFO", "LIBP2P-WARN"}, {"LIBP2P-INFO"}),
    (10, {"OUR-WARN", "OUR-INFO", "LIBP2P-WARN", "LIBP2P-INFO"}, set()),
])
def test_verbosity_levels(level: int, shown: set[str], hidden: set[str]) -> None:
    out = subprocess.run([sys.executable, "-c", CODE, str(level)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(s in out.stderr for s in shown), out.stderr
    assert not any(h in out.stderr for h in hidden), out.stderr
