"""How loud py-libp2p is: the CLI's verbosity applied to py-libp2p's loggers.

Only the CLI calls :func:`quiet_libp2p` (it decides how logging is set up); a starting peer calls
:func:`keep_probe_hang_ups_quiet`; importing this module changes nothing.
"""

from __future__ import annotations

import logging

import libp2p  # noqa: F401  its import resets the "libp2p" logger to WARNING: let that happen before, not after

__all__ = ["keep_probe_hang_ups_quiet", "quiet_libp2p"]


def quiet_libp2p() -> None:
    """Match py-libp2p's logging to the root logger's level: nothing but our own lines without ``-v``, its
    warnings with ``-v``, everything with ``-vv``."""
    level = logging.getLogger().level
    if level > logging.INFO:  # no -v: py-libp2p logs routine stream resets as warnings, some on the root logger
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        logging.getLogger().setLevel(logging.CRITICAL)
        logging.getLogger("sangama_p2p").setLevel(level)  # our own warnings still show
        return
    # libp2p's import gave its logger no handler and propagate=False: its lines reached only logging's last resort
    libp2p_log = logging.getLogger("libp2p")
    libp2p_log.propagate = True
    libp2p_log.setLevel(logging.WARNING if level > logging.DEBUG else level)  # -v: its warnings; -vv: everything


class _ProbeHangUps(logging.Filter):
    """py-libp2p logs ``fail to upgrade mux for peer X`` at ERROR when an inbound connection proves its peer id and
    hangs up before the muxer, which is what every reachability probe does (net/reach.py: a Noise handshake, then
    close): a peer embedded beside a running ``join`` logged it on each check. Kept at DEBUG, as py-libp2p keeps a
    failed security upgrade; installed when a peer starts, never at import."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "fail to upgrade mux for peer %s" and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def keep_probe_hang_ups_quiet() -> None:
    swarm_log = logging.getLogger("libp2p.network.swarm")
    if not any(isinstance(f, _ProbeHangUps) for f in swarm_log.filters):
        swarm_log.addFilter(_ProbeHangUps())
