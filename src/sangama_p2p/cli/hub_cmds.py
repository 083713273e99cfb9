"""``sangama-peer download hf:ORG/REPO[@REV][:FILE.gguf] [--layers A:B] [--dir D]``, and the ``hf:`` resolution
that ``join``, ``generate --local`` and ``chat`` use for ``--model``."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..errors import LayerRangeError
from .argtypes import positive_int

# the hub package is imported where a model is fetched: it reads GGUF and safetensors headers with the model
# package's parsers, which import torch (1.4-2.6 s), and cli/main.py imports this module to build its parser

_RANGE = re.compile(r"^(\d+):(\d+)$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download",
        help="fetch a model (or one stage of it) from the Hugging Face Hub",
        description="Fetch hf:ORG/REPO[@REVISION][:FILE.gguf] into the huggingface_hub cache (HF_HUB_CACHE; "
        "HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply): with --layers only the files or byte ranges holding "
        "those layers. Prints the local checkpoint path to pass as --model.",
    )
    p.add_argument("model", metavar="hf:ORG/REPO[@REV][:FILE.gguf]")
    p.add_argument("--layers", default=None, metavar="A:B", help="only what layers A:B need (default: the whole model)")
    p.add_argument("--dir", type=Path, default=None, metavar="D",
                   help="put the stage copy here (default: under the cache); whole files are links into the cache")
    p.add_argument("--workers", type=positive_int, default=6, help="transfers at once (default: 6)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: shown on a terminal)")
    p.set_defaults(handler=_download)


def parse_layers(value: str | None) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B); None or ``auto...`` -> None (the whole model)."""
    if value is None or str(value).startswith("auto"):
        return None
    m = _RANGE.match(str(value))
    if m is None:
        raise LayerRangeError(f"--layers takes A:B (e.g. 0:10), got {value!r}")
    return int(m.group(1)), int(m.group(2))


def from_hub(model: str | Path, layers: str | tuple[int, int] | None = None, *,
             metadata_only: bool = False) -> tuple[Path, str | None]:
    """(local path, default model id) for ``--model``: an ``hf:`` name is fetched (only ``layers`` when given; no
    weights with ``metadata_only``), anything else is a local path with no id of its own here."""
    from ..hub import is_hub_spec, parse_hub_spec, resolve_model

    text = str(model)
    if not is_hub_spec(text):
        return Path(model), None
    hs = parse_hub_spec(text)
    span = parse_layers(layers) if not isinstance(layers, tuple) else layers
    path = resolve_model(text, layers=span, metadata_only=metadata_only)
    model_id = Path(hs.filename).stem if hs.filename else hs.repo.split("/")[-1]
    return path, model_id


def _download(args: argparse.Namespace) -> int:
    from ..hub import HubSettings, resolve_model

    settings = HubSettings.from_env(max_workers=args.workers)
    path = resolve_model(args.model, layers=parse_layers(args.layers), dest=args.dir, settings=settings,
                         progress=False if args.no_progress else None)
    print(path, flush=True)
    return 0
