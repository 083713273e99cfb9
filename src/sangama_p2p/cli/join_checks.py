"""What ``join`` checks before a stage costs anything: the key file's lock, the checkpoint and the layer range
(before the model loads and before the swarm is dialled, so a mistake costs seconds, not a stage's load time), and,
once in the swarm, whether the range lines up with the ranges other peers serve.

A chain passes from a stage ending at layer ``b`` only to a stage starting at ``b`` (client/routing.py: stages serve
exactly their announced range), so ``5:15`` beside ``0:10, 10:20, 20:30`` is never chained: :func:`chain_warning`
says so, naming the boundaries that would chain.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import SangamaError
from ..model.spec import parse_auto_span, parse_layer_range

# torch, libp2p and the model's modules are imported in the functions (cli/main.py imports every command module,
# and this one with peer_cmds, to build its parser)

__all__ = ["Checked", "chain_warning", "check_checkpoint", "crosses", "hold_key", "warn_if_unchainable"]

log = logging.getLogger(__name__)

SETTLE_S = 20.0  # a range that meets nobody yet is looked at again this much later before a warning is said


def hold_key(key_path: Path | None) -> tuple[Any, IO[str]]:
    """(key pair, the held lock) of ``key_path`` (default ``~/.sangama/peer.key``), creating the key if absent;
    :class:`~sangama_p2p.errors.KeyInUse` when another running peer holds it. Close the lock when the peer stops."""
    from ..net.identity import default_key_path, load_or_create_key_pair, lock_key_file

    path = Path(key_path).expanduser() if key_path is not None else default_key_path()
    lock = lock_key_file(path)  # first: a second peer on this key is refused before anything else happens
    try:
        return load_or_create_key_pair(path), lock
    except BaseException:
        lock.close()
        raise


@dataclass(frozen=True)
class Checked:
    """What the pre-flight learnt of the checkpoint: its layers, its fingerprint, the range asked (None: auto)."""

    num_layers: int
    fingerprint: str
    layers: tuple[int, int] | None


def check_checkpoint(model: str | Path, layers: str) -> Checked:
    """Open ``model`` (its header and tensor index: no weight is loaded) and check ``layers`` against it; the typed
    errors that loading would raise later (a missing or unreadable checkpoint, a range outside the model)."""
    from ..model.checkpoint import open_checkpoint
    from ..model.fingerprint import stage_identity

    ckpt = open_checkpoint(model, tokenizer=False)
    try:
        num_layers = ckpt.spec.num_layers
        text = str(layers)
        wanted: tuple[int, int] | None = None
        if text.startswith("auto"):
            parse_auto_span(text, num_layers)
        else:
            r = parse_layer_range(text)
            ckpt.spec.check_range(r.start, r.end)
            wanted = (r.start, r.end)
        fingerprint = stage_identity(ckpt.spec, ckpt.source).fingerprint
    finally:
        ckpt.close()
    return Checked(num_layers, fingerprint, wanted)


def chain_warning(mine: tuple[int, int], others: Sequence[tuple[int, int]], num_layers: int) -> str | None:
    """Why ``mine`` cannot be chained with the ranges ``others`` serve (None when it can, or when nobody else
    serves): a chain reaches ``start`` only from layer 0 or a range ending there, and leaves ``end`` only at the
    model's last layer or into a range starting there."""
    if not others:
        return None
    start, end = mine
    ends = {e for _, e in others} | {0}
    starts = {s for s, _ in others} | {num_layers}
    problems = []
    if start not in ends:
        problems.append(f"no range ends at {start}")
    if end not in starts:
        problems.append(f"none starts at {end}")
    if not problems:
        return None
    served = ", ".join(f"{s}:{e}" for s, e in sorted(set(others)))
    bounds = ", ".join(str(b) for b in sorted(ends | starts))
    return (f"layers {start}:{end} do not line up with the ranges the swarm serves ({served}): "
            f"{' and '.join(problems)}, and a chain passes between stages only where one ends and the next starts, "
            f"so no chain can use this stage until peers serve ranges that meet it; the swarm's boundaries are "
            f"{bounds} (e.g. --layers A:B with A and B among them)")


def crosses(mine: tuple[int, int], others: Sequence[tuple[int, int]]) -> bool:
    """Whether a boundary of ``mine`` falls strictly inside a range ``others`` serve (``1:3`` beside ``0:2, 2:4``): a
    mistake no later peer mends. A boundary that no range reaches (the next range not served yet) is not one."""
    return any(s < b < e for b in mine for s, e in others)


async def warn_if_unchainable(node: Any, model_id: str, checked: Checked, later: Any = None) -> str | None:
    """Look up the peers serving ``model_id`` (of this very checkpoint) and print :func:`chain_warning` on stderr;
    returns it. Nothing when the range was auto (chosen from the swarm) or nobody else serves. A range that only meets
    nobody yet (no other range :func:`crosses` it: the stages of a fleet started together see each other come up
    one by one) is looked at again :data:`SETTLE_S` later in the nursery ``later`` and said only if it still cannot
    chain (without ``later``: not said)."""
    if checked.layers is None:
        return None
    spans = await _served(node, model_id, checked)
    if (warning := chain_warning(checked.layers, spans, checked.num_layers)) is None:
        return None
    if not crosses(checked.layers, spans):
        if later is not None:
            later.start_soon(_warn_later, node, model_id, checked)
        return None
    print(f"warning: {warning}", file=sys.stderr, flush=True)
    return warning


async def _warn_later(node: Any, model_id: str, checked: Checked) -> None:
    import trio  # here: the CLI's parser imports this module and must stay light (tests/test_house.py)

    await trio.sleep(SETTLE_S)
    spans = await _served(node, model_id, checked)
    if checked.layers is not None and (warning := chain_warning(checked.layers, spans, checked.num_layers)):
        print(f"warning: {warning}", file=sys.stderr, flush=True)


async def _served(node: Any, model_id: str, checked: Checked) -> list[tuple[int, int]]:
    """The ranges the other peers of ``checked``'s checkpoint serve; none when the look-up fails."""
    from ..net.discovery import find_serving_peers

    try:
        records = await find_serving_peers(node, model_id, include_self=False, fingerprint=checked.fingerprint,
                                            walk=False)
    except SangamaError as exc:  # a look-up for a warning never stops the stage
        log.debug("looking up the ranges of %s: %s", model_id, exc)
        return []
    return [(r.start, r.end) for r in records]
