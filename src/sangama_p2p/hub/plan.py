"""Which files and byte ranges a stage needs (pure: names, offsets and sizes in, sets and spans out).

A stage of layers [start, end) of an L-layer model reads the tensors :meth:`StageModel.load` reads: its decoder
layers; the token embedding when it is first (or last with tied embeddings or an MTP layer); the final norm, the head
and the MTP layer when it is last. The model fingerprint (model/fingerprint.py) also reads
``SAMPLE_WINDOWS`` windows of ``SAMPLE_BYTES`` bytes of *every* tensor: :func:`sample_spans` names them, so a partial
copy can hold exactly those bytes of the tensors it does not serve.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..model.fingerprint import SAMPLE_BYTES, SAMPLE_WINDOWS
from ..model.weights import _canonical, layer_of

__all__ = ["Span", "covers", "gguf_stage_tensors", "merge_spans", "safetensors_stage_tensors", "sample_spans"]

Span = tuple[int, int]  # [start, end) in bytes
_BLK = re.compile(r"^blk\.(\d+)\.")


def sample_spans(offset: int, nbytes: int) -> list[Span]:
    """The byte windows of one tensor (stored at ``offset``, ``nbytes`` long) that the fingerprint samples."""
    span = max(nbytes - SAMPLE_BYTES, 0)
    out = []
    for k in range(SAMPLE_WINDOWS):
        at = offset + span * k // (SAMPLE_WINDOWS - 1)
        out.append((at, min(at + SAMPLE_BYTES, offset + nbytes)))
    return [s for s in out if s[1] > s[0]]


def merge_spans(spans: Iterable[Span], gap: int = 0) -> list[Span]:
    """Sorted, non-overlapping spans; spans closer than ``gap`` bytes become one (fewer requests)."""
    out: list[list[int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covers(have: Iterable[Span], want: Iterable[Span]) -> bool:
    """Whether the spans ``have`` hold every byte of ``want``."""
    merged = merge_spans(have)
    for a, b in want:
        if b <= a:
            continue
        if not any(x <= a and b <= y for x, y in merged):
            return False
    return True


def safetensors_stage_tensors(names: Iterable[str], num_layers: int, start: int, end: int, tied: bool) -> set[str]:
    """The stored names (as in ``model.safetensors.index.json``) a stage of layers [start, end) loads."""
    names = list(names)
    last = end == num_layers
    has_mtp = any(_canonical(n).startswith("mtp.") for n in names)
    out = set()
    for raw in names:
        name = _canonical(raw)
        layer = layer_of(name)
        if layer is not None:
            keep = start <= layer < end
        elif name == "model.embed_tokens.weight":
            keep = start == 0 or (last and (tied or has_mtp))
        else:
            keep = last and (name in ("model.norm.weight", "lm_head.weight") or name.startswith("mtp."))
        if keep:
            out.add(raw)
    return out


def gguf_stage_tensors(names: Iterable[str], num_layers: int, start: int, end: int) -> set[str]:
    """The GGUF tensor names a stage of layers [start, end) loads; blocks at or past ``num_layers`` are MTP (nextn)
    layers of the last stage, and small global tensors (``rope_freqs``...) go to every stage."""
    names = list(names)
    last = end == num_layers
    untied = "output.weight" in names
    out = set()
    for name in names:
        m = _BLK.match(name)
        if m is not None:
            i = int(m.group(1))
            keep = start <= i < end or (last and i >= num_layers)
        elif name == "token_embd.weight":
            keep = start == 0 or (last and (not untied or any(_BLK.match(n) and int(_BLK.match(n).group(1)) >= num_layers
                                                             for n in names)))
        elif name in ("output.weight", "output_norm.weight"):
            keep = last
        else:
            keep = True
        if keep:
            out.add(name)
    return out
