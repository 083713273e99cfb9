"""Per-session state of one stage, preallocated: attention KV by absolute position, Gated DeltaNet windows.

A session's memory is fixed when it opens and accounted in :attr:`SessionState.nbytes`:

- attention layers: K and V ``[1, kv_heads, capacity, head_dim]`` each; rolling back is moving ``position``;
- Gated DeltaNet layers: the conv window ``[conv_dim, K-1]`` and the fp32 recurrent state ``[Hv, Dk, Dv]``, plus a
  ring of ``ring`` snapshots of both, written during multi-token steps, so that a rollback to any of the last
  ``ring`` positions selects a snapshot instead of recomputing (nothing is cloned before a step).

Which steps a session may take, which snapshot a rollback selects and what a step keeps are decided by
:class:`~sangama_p2p.positions.SessionPositions` (``SessionState.window``, pure); this module holds the tensors and
copies the snapshot it names.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import CapacityError
from ..positions import SessionPositions
from .spec import FULL, LINEAR, ModelSpec

__all__ = ["LinearLayerState", "AttentionLayerState", "SessionState", "Segment"]


@dataclasses.dataclass
class AttentionLayerState:
    k: torch.Tensor  # [1, kv_heads, capacity, head_dim]: a batch of one, as attention takes it
    v: torch.Tensor  # [1, kv_heads, capacity, head_dim]


@dataclasses.dataclass
class LinearLayerState:
    conv: torch.Tensor  # [conv_dim, K-1]  the last K-1 inputs of the causal conv, oldest first
    rec: torch.Tensor  # [Hv, Dk, Dv] fp32 recurrent state (stored transposed: see rec_layout)
    ring_conv: torch.Tensor  # [ring, conv_dim, K-1]  window after each position of the last multi-token step
    ring_rec: torch.Tensor  # [ring, Hv, Dk, Dv]      recurrent state after each position of that step


def rec_layout(*shape: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zeros of ``[..., Hv, Dk, Dv]`` stored as ``[..., Hv, Dv, Dk]`` (a transposed view): each value row of a head's
    state contiguous, the layout of llama.cpp's gated delta rule (``ggml_gated_delta_net``), which then reads and
    writes it as stored, no transposing copies (model/gguf/ggml_layer.py); torch's products take either layout.

    A session's own state (``[Hv, Dk, Dv]``) is preceded in its storage by ``Hv * Dv`` floats of scratch: ggml's op
    writes one token's outputs and then the new state into one tensor, so with the scratch before the state it
    writes the state in place (``ggml_layer.rec_region``) instead of a copy the graph copies back."""
    if len(shape) == 3 and torch.device(device).type == "cpu":
        hv, dk, dv = shape
        flat = torch.zeros(hv * dv * (1 + dk), dtype=torch.float32, device=device)
        return flat[hv * dv:].view(hv, dv, dk).transpose(-1, -2)
    return torch.zeros(*shape[:-2], shape[-1], shape[-2], dtype=torch.float32, device=device).transpose(-1, -2)


class SessionState:
    """All caches one session holds on one stage (layers ``[start, end)``, plus the MTP layer if given)."""

    def __init__(
        self,
        spec: ModelSpec,
        start: int,
        end: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ring: int = 0,
        extra_attention_layers: int = 0,
    ) -> None:
        if capacity <= 0:
            raise CapacityError(f"session capacity must be positive, got {capacity}")
        if capacity > spec.max_position_embeddings:
            raise CapacityError(
                f"session capacity {capacity} exceeds the model's max_position_embeddings "
                f"{spec.max_position_embeddings}"
            )
        self.layers: dict[int, AttentionLayerState | LinearLayerState] = {}
        kv_shape = (1, spec.num_kv_heads, capacity, spec.head_dim)
        for i in range(start, end):
            if spec.layer_types[i] == FULL:
                self.layers[i] = AttentionLayerState(
                    torch.zeros(kv_shape, dtype=dtype, device=device), torch.zeros(kv_shape, dtype=dtype, device=device)
                )
            elif spec.layer_types[i] == LINEAR:
                conv = (spec.linear_conv_dim, spec.linear_conv_kernel - 1)
                rec = (spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim)
                self.layers[i] = LinearLayerState(
                    torch.zeros(conv, dtype=dtype, device=device),
                    rec_layout(*rec, device=device),
                    torch.zeros((ring, *conv), dtype=dtype, device=device),
                    rec_layout(ring, *rec, device=device),
                )
        # MTP layers (full attention) get keys -1, -2, ...
        for j in range(extra_attention_layers):
            self.layers[-1 - j] = AttentionLayerState(
                torch.zeros(kv_shape, dtype=dtype, device=device), torch.zeros(kv_shape, dtype=dtype, device=device)
            )
        recurrent = any(isinstance(s, LinearLayerState) for s in self.layers.values())
        self.window = SessionPositions(capacity, ring, recurrent=recurrent)

    @property
    def capacity(self) -> int:
        return self.window.capacity

    @property
    def ring(self) -> int:
        return self.window.ring

    @property
    def position(self) -> int:
        """Tokens whose effects all caches hold."""
        return self.window.position

    @property
    def nbytes(self) -> int:
        total = 0
        for st in self.layers.values():
            for t in dataclasses.astuple(st):
                total += t.numel() * t.element_size()
        return total

    def has_linear(self) -> bool:
        return self.window.recurrent

    def roll_back(self, pos: int) -> None:
        """Make the caches hold exactly positions [0, pos): select ring snapshots, move the position."""
        slot = self.window.roll_back(pos)
        if slot is None:
            return
        linear = [st for st in self.layers.values() if isinstance(st, LinearLayerState)]
        torch._foreach_copy_([t for st in linear for t in (st.conv, st.rec)],  # one call for all the copies
                             [t for st in linear for t in (st.ring_conv[slot], st.ring_rec[slot])])


@dataclasses.dataclass
class Segment:
    """One session's share of a batched step: positions [start, start + length) of ``state``."""

    state: SessionState
    start: int
    length: int
