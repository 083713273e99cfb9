"""Models from the Hugging Face Hub, one stage at a time (``hf:ORG/REPO[@REVISION][:FILE.gguf]``).

I/O through ``huggingface_hub`` (threads, no trio); see :func:`resolve_model` and docs/operations.md.
"""

from .fetch import HubSettings
from .resolve import resolve_model
from .spec import HubSpec, is_hub_spec, parse_hub_spec

__all__ = ["HubSettings", "HubSpec", "is_hub_spec", "parse_hub_spec", "resolve_model"]
