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

from ..model.pin import Pin, local_pin, merge_pins, require_pin

__all__ = ["Pin", "add_fingerprint_arg", "local_pin", "merge_pins", "parse_pin", "require_pin"]

_PIN = re.compile(r"^(?P<fp>[0-9a-f]{32}):(?P<layers>[1-9][0-9]*)$")


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
