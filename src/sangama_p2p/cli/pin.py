"""Which checkpoint a client command chains: the *pin* (fingerprint and depth) from the client's own copy or from
``--fingerprint FP:LAYERS``, and the refusal of an unpinned model id in a public swarm.

Any peer may announce any model id, so a bare id names nothing a stranger cannot also claim: five peers of another
checkpoint under the honest id took over every client that did not pin (issue 26). A client therefore always knows
the checkpoint it wants:

* ``--model DIR`` (config + weights) or ``--model FILE.gguf``: the fingerprint and depth of that copy (the same for
  ``--model ID --tokenizer DIR|FILE.gguf`` when the tokenizer's source is a checkpoint; ``--fingerprint`` wins over
  it, for a tokenizer borrowed from another checkpoint);
* ``--model hf:ORG/REPO:FILE.gguf`` or ``hf:ORG/REPO`` of safetensors: of the Hub files, from their headers and
  the fingerprint's sample windows (a few KiB per tensor, fetched once; no weights);
* ``--fingerprint FP:LAYERS``: explicitly (``sangama-peer status`` prints the pin of each lineup, a stage prints its
  own when it joins);
* a directory with only a config (``--tokenizer DIR``) gives the depth alone.

The depth is never a vote of the records (:func:`sangama_p2p.net.lineup.choose_lineup`). Without a fingerprint a
public swarm is refused with a message that says how to pin; a private fleet (``--fleet-secret-file``: every peer
holds the secret) accepts a bare id.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import RouteError, SangamaError

__all__ = ["Pin", "add_fingerprint_arg", "local_pin", "parse_pin", "require_pin"]

_PIN = re.compile(r"^(?P<fp>[0-9a-f]{32}):(?P<layers>[1-9][0-9]*)$")


@dataclass(frozen=True)
class Pin:
    """What a client chains: only peers of ``fingerprint`` (None: any group), a model of ``num_layers`` layers
    (None: the depth the chosen group's records agree on); ``source`` names where it came from, for messages."""

    fingerprint: str | None = None
    num_layers: int | None = None
    source: str = ""

    def __str__(self) -> str:
        return f"{self.fingerprint}:{self.num_layers}" if self.fingerprint else "-"


def parse_pin(text: str) -> Pin:
    """``FP:LAYERS`` (32 lowercase hex digits, the model's depth) as argparse's type; anything else is refused."""
    m = _PIN.match(text.strip().lower())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"expected FINGERPRINT:LAYERS (32 hex digits and the model's layer count, as `sangama-peer status` "
            f"prints it), got {text!r}")
    return Pin(m.group("fp"), int(m.group("layers")), "--fingerprint")


def add_fingerprint_arg(p: argparse.ArgumentParser) -> None:
    """``--fingerprint FP:LAYERS``, for the commands that generate through the swarm."""
    p.add_argument("--fingerprint", type=parse_pin, default=None, metavar="FP:LAYERS",
                   help="chain only peers of this checkpoint (`sangama-peer status` prints each lineup's pin); "
                   "needed in a public swarm when --model is a bare model id")


def local_pin(model: Path, tokenizer: Path | None) -> Pin:
    """The pin that the client's own files give: a checkpoint (``model``, else the ``tokenizer`` one: a directory
    with weights, a ``.gguf`` file, or a Hub GGUF's sparse copy with its sample windows) gives fingerprint and
    depth; a directory with only a config, or a GGUF's metadata, the depth."""
    for where in (model, tokenizer):
        if where is not None and _is_checkpoint(where):
            from ..model.fingerprint import checkpoint_identity

            ident = checkpoint_identity(where)  # 0.14 s for SmolLM2-135M: the headers and samples
            return Pin(ident.fingerprint, ident.num_layers, str(where))
    for where in (model, tokenizer):
        if where is not None and where.is_dir() and (where / "config.json").is_file():
            return Pin(None, _depth(where), str(where))
        if where is not None and where.suffix == ".gguf" and where.is_file():
            return Pin(None, _gguf_depth(where), str(where))
    return Pin()


def _is_checkpoint(path: Path) -> bool:
    if path.suffix == ".gguf":
        return path.is_file()
    weights = ("model.safetensors", "model.safetensors.index.json")
    return (path / "config.json").is_file() and any((path / w).is_file() for w in weights)


def _depth(directory: Path) -> int | None:
    from ..model.spec import ModelSpec

    try:
        return ModelSpec.from_dir(directory).num_layers
    except SangamaError:  # a config this runtime does not read: the records' depth, as before
        return None


def _gguf_depth(path: Path) -> int | None:
    from ..model.gguf.config import decoder_depth
    from ..model.gguf.reader import read_metadata

    try:
        return decoder_depth(read_metadata(path).metadata)
    except (SangamaError, KeyError, TypeError, ValueError):
        return None


def merge_pins(local: Pin, given: Pin | None, *, strict: bool = True) -> Pin:
    """``--fingerprint`` beside a local copy: they must agree (else the user named two checkpoints); not
    ``strict`` (the copy is only the tokenizer's, say a base model's for its fine-tune), ``--fingerprint`` wins."""
    if given is None:
        return local
    if not strict:
        return given
    if local.fingerprint is not None and local.fingerprint != given.fingerprint:
        raise RouteError(f"--fingerprint {given} is not the checkpoint {local.source} ({local}): drop one of them")
    if local.num_layers is not None and local.num_layers != given.num_layers:
        raise RouteError(f"--fingerprint {given} says {given.num_layers} layers, {local.source} has "
                         f"{local.num_layers}")
    return given


def require_pin(pin: Pin, model: str, *, private: bool) -> None:
    """In a public swarm an unpinned model id chains whatever checkpoint most peers announce under it: refuse."""
    if pin.fingerprint is None and not private:
        raise RouteError(
            f"{model!r} does not name a checkpoint, and in a public swarm any peer can announce another checkpoint "
            "under this model id. Pin it: --model DIR|FILE.gguf|hf:ORG/REPO:FILE.gguf (your copy, or the Hub's, "
            "of the checkpoint), or --fingerprint FP:LAYERS (`sangama-peer status --model ID` prints it); in a "
            "private fleet (--fleet-secret-file) a bare model id is enough")
