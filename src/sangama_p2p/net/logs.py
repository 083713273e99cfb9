"""How loud py-libp2p is: the CLI's verbosity applied to py-libp2p's loggers.

Only the CLI calls :func:`quiet_libp2p` (it decides how logging is set up); importing this module changes nothing.
"""

from __future__ import annotations

import logging

import libp2p  # noqa: F401  its import resets the "libp2p" logger to WARNING: let that happen before, not after

__all__ = ["quiet_libp2p"]


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
