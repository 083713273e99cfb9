"""Per-session state of one stage, preallocated: attention KV by absolute position, Gated DeltaNet windows.

A session's memory is fixed when it opens and accounted in :attr:`SessionState.nbytes`:

- attention layers: K and V ``[1, kv_heads, capacity, head_dim]`` each; rolling back is moving ``position``;
- Gated DeltaNet layers: the conv window ``[conv_dim, K-1]`` and the fp32 recurrent state ``[Hv, Dk, Dv]``, plus a
  ring of ``ring`` snapshots of both, written during multi-token steps, so that a rollback to any of the last
  ``ring`` positions selects a snapshot instead of recomputing (nothing is cloned before a step).
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import CapacityError, SessionStateError
from .spec import FULL, LINEAR, ModelSpec

__all__ = ["LinearLayerState", "AttentionLayerState", "SessionState", "Segment"]


@dataclasses.dataclass
class AttentionLayerState:
    k: torch.Tensor  # [1, kv_heads, capacity, head_dim]: a batch of one, as attention takes it
    v: torch.Tensor  # [1, kv_heads, capacity, head_dim]


@dataclasses.dataclass
class LinearLayerState:
    conv: torch.Tensor  # [conv_dim, K-1]  the last K-1 inputs of the causal conv, oldest first
    rec: torch.Tensor  # [Hv, Dk, Dv] fp32 recurrent state
    ring_conv: torch.Tensor  # [ring, conv_dim, K-1]  window after each position of the last multi-token step
    ring_rec: torch.Tensor  # [ring, Hv, Dk, Dv]      recurrent state after each position of that step


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
        self.capacity = capacity
        self.position = 0  # tokens whose effects all caches hold
        self.ring = ring
        # Positions covered by the ring: ring slot i holds the state after position ring_base + i.
        self.ring_base = -1
        self.ring_len = 0
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
                    torch.zeros(rec, dtype=torch.float32, device=device),
                    torch.zeros((ring, *conv), dtype=dtype, device=device),
                    torch.zeros((ring, *rec), dtype=torch.float32, device=device),
                )
        # MTP layers (full attention) get keys -1, -2, ...
        for j in range(extra_attention_layers):
            self.layers[-1 - j] = AttentionLayerState(
                torch.zeros(kv_shape, dtype=dtype, device=device), torch.zeros(kv_shape, dtype=dtype, device=device)
            )

    @property
    def nbytes(self) -> int:
        total = 0
        for st in self.layers.values():
            for t in dataclasses.astuple(st):
                total += t.numel() * t.element_size()
        return total

    def check_step(self, start_pos: int, length: int) -> None:
        """Validate a step over positions [start_pos, start_pos + length) before any state changes."""
        if length <= 0:
            raise SessionStateError("a step needs at least one position")
        if start_pos < 0:
            raise SessionStateError(f"negative start position {start_pos}")
        if start_pos > self.position:
            raise SessionStateError(
                f"start position {start_pos} is ahead of the session, which holds {self.position} positions"
            )
        if start_pos + length > self.capacity:
            raise CapacityError(
                f"positions up to {start_pos + length} exceed the session's capacity of {self.capacity} tokens"
            )
        if start_pos < self.position and not self.can_roll_back_to(start_pos):
            raise SessionStateError(
                f"cannot roll back from position {self.position} to {start_pos}: only the last {self.ring_len} "
                "positions of the previous step are kept"
            )

    def has_linear(self) -> bool:
        return any(isinstance(s, LinearLayerState) for s in self.layers.values())

    def can_roll_back_to(self, pos: int) -> bool:
        if pos == self.position:
            return True
        if not self.has_linear():
            return 0 <= pos < self.position
        # the state "after position pos-1" must be in the ring
        return self.ring_len > 0 and self.ring_base <= pos - 1 < self.ring_base + self.ring_len

    def roll_back(self, pos: int) -> None:
        """Make the caches hold exactly positions [0, pos): select ring snapshots, move the position."""
        if pos == self.position:
            return
        if not self.can_roll_back_to(pos):
            raise SessionStateError(f"cannot roll back from position {self.position} to {pos}")
        slot = pos - 1 - self.ring_base
        linear = [st for st in self.layers.values() if isinstance(st, LinearLayerState)]
        if linear:  # one call for all the copies
            torch._foreach_copy_([t for st in linear for t in (st.conv, st.rec)],
                                 [t for st in linear for t in (st.ring_conv[slot], st.ring_rec[slot])])
        self.position = pos
        # snapshots after pos are now stale; those up to pos stay valid
        self.ring_len = slot + 1


@dataclasses.dataclass
class Segment:
    """One session's share of a batched step: positions [start, start + length) of ``state``."""

    state: SessionState
    start: int
    length: int
