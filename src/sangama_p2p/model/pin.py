"""The *pin* of a client: the checkpoint (fingerprint and depth) it chains, from the client's own copy.

Any peer may announce any model id, so a bare id names nothing a stranger cannot also claim: five peers of another
checkpoint under the honest id took over every client that did not pin (issue 26). The command line's flags are in
:mod:`sangama_p2p.cli.pin`; an embedded :class:`~sangama_p2p.Peer` pins from its own stage or its ``tokenizer_path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import RouteError, SangamaError

__all__ = ["CLI_HOW", "EMBEDDED_HOW", "Pin", "local_pin", "merge_pins", "require_pin"]


@dataclass(frozen=True)
class Pin:
    """What a client chains: only peers of ``fingerprint`` (None: any group), a model of ``num_layers`` layers
    (None: the depth the chosen group's records agree on); ``source`` names where it came from, for messages."""

    fingerprint: str | None = None
    num_layers: int | None = None
    source: str = ""

    def __str__(self) -> str:
        return f"{self.fingerprint}:{self.num_layers}" if self.fingerprint else "-"


def local_pin(model: Path, tokenizer: Path | None) -> Pin:
    """The pin that the client's own files give: a checkpoint (``model``, else the ``tokenizer`` one: a directory
    with weights, a ``.gguf`` file, or a Hub GGUF's sparse copy with its sample windows) gives fingerprint and
    depth; a directory with only a config, or a GGUF's metadata, the depth."""
    for where in (model, tokenizer):
        if where is not None and _is_checkpoint(where):
            from .fingerprint import checkpoint_identity

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
    from .spec import ModelSpec

    try:
        return ModelSpec.from_dir(directory).num_layers
    except SangamaError:  # a config this runtime does not read: the records' depth, as before
        return None


def _gguf_depth(path: Path) -> int | None:
    from .gguf.config import decoder_depth
    from .gguf.reader import read_metadata

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


CLI_HOW = ("--model DIR|FILE.gguf|hf:ORG/REPO[:FILE.gguf] (your copy, or the Hub's, of the checkpoint), or "
           "--fingerprint FP:LAYERS (`sangama-peer status --model ID` prints it); in a private fleet "
           "(--fleet-secret-file) a bare model id is enough")
EMBEDDED_HOW = ("PeerConfig(tokenizer_path=DIR|FILE.gguf) of the checkpoint, ClientConfig(fingerprint=FP, "
                "num_layers=N) (`sangama-peer status --model ID` prints FP:N), or serve a stage of it; in a private "
                "fleet (HostConfig.fleet_secret) a bare model id is enough")


def require_pin(pin: Pin, model: str, *, private: bool, how: str = CLI_HOW) -> None:
    """In a public swarm an unpinned model id chains whatever checkpoint most peers announce under it: refuse,
    saying ``how`` to pin."""
    if pin.fingerprint is None and not private:
        raise RouteError(
            f"{model!r} does not name a checkpoint, and in a public swarm any peer can announce another checkpoint "
            f"under this model id. Pin it: {how}")
