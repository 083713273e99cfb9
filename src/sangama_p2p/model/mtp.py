"""Qwen3.5's multi-token-prediction (MTP) layer, used on the last stage to draft guesses.

Checkpoint layout: ``mtp.fc.weight`` [H, 2H], ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``,
``mtp.layers.0.*`` (one full-attention MoE decoder layer with its own KV cache) and ``mtp.norm.weight``; the
embedding and the head are the main model's. At position p, with ``h_p`` the main model's final (normed) hidden
state and ``x_{p+1}`` the next token::

    u = fc(cat[norm_e(embed(x_{p+1})), norm_h(h_p)]) -> layer (KV at position p) -> norm -> head = logits of x_{p+2}

Several guesses reuse the one layer autoregressively: the MTP's own output stands in for ``h`` at the next position.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .layers import DecoderLayer
from .linear import Loader, linear, norm_weight
from .ops import rms_norm
from .spec import FULL, ModelSpec
from .state import Segment
from .weights import Weight

__all__ = ["MTP_KEY", "MTPLayer"]

MTP_KEY = -1  # the MTP layer's key in a SessionState


class MTPLayer:
    def __init__(self, spec: ModelSpec, load: Loader) -> None:
        self.spec = spec
        self.fc = load("mtp.fc.weight")
        # the two pre-fc norms' scales as rows [2, H]: embedding, hidden (both norms in one call)
        self.pre_fc_norm = torch.stack((norm_weight(load("mtp.pre_fc_norm_embedding.weight"), spec),
                                        norm_weight(load("mtp.pre_fc_norm_hidden.weight"), spec)))
        self.layer = DecoderLayer(spec, lambda n: load("mtp.layers.0." + n), MTP_KEY, FULL)
        self.norm = norm_weight(load("mtp.norm.weight"), spec)

    def weights(self) -> Iterator[Weight]:
        yield from (self.fc, self.pre_fc_norm, self.norm)
        yield from self.layer.weights()

    def forward(
        self,
        hidden: torch.Tensor,
        next_embed: torch.Tensor,
        segments: list[Segment],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """hidden: [N, H] normed states at positions p; next_embed: [N, H] embeddings of x_{p+1}. Returns [N, H]."""
        eps, n = self.spec.rms_norm_eps, hidden.shape[0]
        x = rms_norm(torch.cat((next_embed, hidden), dim=-1).view(n, 2, -1), self.pre_fc_norm, eps)  # [N, 2, H]
        x = linear(x.view(n, -1), self.fc)
        x = self.layer.forward(x, segments, cos, sin)
        return rms_norm(x, self.norm, eps)
