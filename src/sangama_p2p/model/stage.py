"""A stage: the layers [start, end) of a model, loaded alone, run over batched steps of many sessions.

The first stage embeds token ids; the last applies the final norm and the head (and holds the MTP layer when the
checkpoint has one). Between stages travel hidden states ``[N, hidden]``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Sequence

import torch

from ..errors import CapacityError, CheckpointError, ModelError, SessionStateError, UnsupportedModelError
from .head import Head
from .layers import DecoderLayer
from .linear import MIN_ROWS, linear, norm_weight, pad_rows
from .mtp import MTPLayer
from .ops import rms_norm, rope_inv_freq, rope_tables
from .spec import ModelSpec
from .state import Segment, SessionState
from .weights import FusedWeight, TensorSource, Weight, dense, weight_nbytes

__all__ = ["StageModel", "StepInput"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise UnsupportedModelError(f"unsupported compute dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPES:
        raise UnsupportedModelError(f"unsupported compute dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclasses.dataclass
class StepInput:
    """One session's new positions in a batched step: token ids (first stage) or hidden states (later stages)."""

    state: SessionState
    start: int
    tokens: torch.Tensor | None = None  # [T] int64
    hidden: torch.Tensor | None = None  # [T, hidden]

    @property
    def length(self) -> int:
        src = self.tokens if self.tokens is not None else self.hidden
        return 0 if src is None else int(src.shape[0])


class StageModel:
    """Layers [start, end) of a model plus, at the ends, the embedding or the final norm and head."""

    def __init__(self, spec: ModelSpec, start: int, end: int, dtype: torch.dtype, device: torch.device) -> None:
        spec.check_range(start, end)
        self.spec, self.start, self.end = spec, start, end
        self.dtype, self.device = dtype, device
        self.is_first = start == 0
        self.is_last = end == spec.num_layers
        self.embed: Weight | None = None
        self.layers: dict[int, DecoderLayer] = {}
        self.final_norm: torch.Tensor | None = None
        self.head: Weight | None = None
        self.exact_head: Head | None = None  # the head's float32 second pass (model/head.py), when it needs one
        self.mtp: MTPLayer | None = None
        # pad dense products to this many rows so that results do not depend on batch composition (linear.MIN_ROWS)
        self.min_rows = 0
        self.inv_freq = rope_inv_freq(spec).to(device)
        self._rope: torch.Tensor | None = None  # cos and sin of positions 0..L-1: [2, L, 1, head_dim] (rope_rows)
        self.loaded_names: list[str] = []

    # ---- loading -------------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        source: TensorSource,
        start: int,
        end: int,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        mtp: bool = True,
        batch_invariant: bool = False,
        fused: bool = True,
    ) -> "StageModel":
        """Read only the tensors of layers [start, end) (+ embedding if first, + norm/head/MTP if last).

        ``mtp``: load the checkpoint's MTP layer on the last stage, when it has one (it drafts guesses).
        ``fused``: repack quantized (and narrower float) weights once, at load, for fused kernels when the source can
        (``GGUFSource.repack``); False keeps them as stored and dequantizes them on every use.
        ``batch_invariant``: make every session's numbers independent of what it is batched with (costs speed on
        CPU for small batches, see ``linear.MIN_ROWS``).
        """
        dt = resolve_dtype(dtype)
        stage = cls(spec, start, end, dt, torch.device(device))
        stage.min_rows = 16 if batch_invariant else 0
        want_mtp = stage.is_last and mtp and spec.mtp_num_layers > 0 and source.has("mtp.fc.weight")
        packer = getattr(source, "repack", None) if fused and stage.device.type in ("cpu", "cuda") else None

        def pack(w: Weight, head: bool = False) -> Weight:  # (on the CPU: a CUDA stage's are moved once packed)
            return packer(w, dt, stage.device, head) if packer is not None else w

        def place(w: Weight) -> Weight:
            if isinstance(w, torch.Tensor) or hasattr(w, "to"):  # quantized weights move their blocks
                return w.to(stage.device)  # type: ignore[union-attr]
            return w

        def read(name: str) -> Weight:
            if not source.has(name):
                raise CheckpointError(f"checkpoint lacks tensor {name!r} needed by layers {start}:{end}")
            stage.loaded_names.append(name)
            return source.get(name, dt)

        def get(name: str, *, head: bool = False) -> Weight:
            return place(pack(read(name), head))

        embed = None  # as stored: a tied head is packed from it, the embedding itself is moved as it is
        if stage.is_first or (stage.is_last and (spec.tie_word_embeddings or want_mtp)):
            embed = read("model.embed_tokens.weight")
            stage.embed = place(embed)  # looked up by rows (take_rows), not multiplied
        # Drop the mapped pages a layer's load read (a repacking's or a concatenation's sources: the weights built
        # from them hold copies of their own; a weight used straight from the map faults its pages back at first use).
        release = getattr(source, "release_pages", None)
        for i in range(start, end):
            prefix = f"model.layers.{i}."
            stage.layers[i] = DecoderLayer(spec, lambda n, p=prefix: get(p + n), i, spec.layer_types[i])
            _settle(stage.layers[i].weights())
            if release is not None:  # layer by layer, so the pages a repacking or a concatenation read do not pile up
                release()
        if stage.is_last:
            stage.final_norm = norm_weight(get("model.norm.weight"), spec)
            stored = embed if spec.tie_word_embeddings else read("lm_head.weight")
            stage.head = place(pack(stored, head=True))  # type: ignore[arg-type]
            stage.exact_head = Head.build(stage.head, stored, dt,  # type: ignore[arg-type]
                                          getattr(source, "release_view", None))
            if want_mtp:
                stage.mtp = MTPLayer(spec, get)
            _settle([stage.head, *(stage.mtp.weights() if stage.mtp is not None else ())])
        if release is not None:
            release()  # the repacked weights hold their own copies of the blocks they came from
        return stage

    def weights(self) -> Iterator[Weight]:
        seen: set[int] = set()
        for w in self._all_weights():
            if id(w) not in seen:
                seen.add(id(w))
                yield w

    def _all_weights(self) -> Iterator[Weight]:
        if self.embed is not None:
            yield self.embed
        for layer in self.layers.values():
            yield from layer.weights()
        if self.final_norm is not None:
            yield self.final_norm
        if self.head is not None:
            yield self.head
        if self.mtp is not None:
            yield from self.mtp.weights()

    @property
    def resident_bytes(self) -> int:
        return sum(weight_nbytes(w) for w in self.weights())

    # ---- sessions ------------------------------------------------------------------------------------------
    def new_session(self, capacity: int, *, ring: int = 0, budget: int | None = None) -> SessionState:
        """Preallocate one session's caches for up to ``capacity`` positions.

        ``ring``: how many positions of a multi-token step can be rolled back (max guesses + 1). ``budget``: the
        most bytes the session may take; a session that would need more is refused before anything is allocated.
        """
        need = self.session_bytes(capacity, ring)
        if budget is not None and need > budget:
            raise CapacityError(
                f"a session of {capacity} positions with a rollback ring of {ring} needs {need} bytes on layers "
                f"{self.start}:{self.end}, over its budget of {budget} bytes"
            )
        return SessionState(self.spec, self.start, self.end, capacity, dtype=self.dtype, device=self.device,
                            ring=ring, extra_attention_layers=1 if self.mtp is not None else 0)

    def session_bytes(self, capacity: int, ring: int = 0) -> int:
        """Bytes a session of this capacity would take, without allocating it."""
        el = torch.tensor([], dtype=self.dtype).element_size()
        spec = self.spec
        kv_layers = len(spec.attention_layers(self.start, self.end)) + (1 if self.mtp is not None else 0)
        kv = kv_layers * 2 * spec.num_kv_heads * spec.head_dim * el * capacity
        n_lin = len(spec.linear_layers(self.start, self.end))
        conv = spec.linear_conv_dim * (spec.linear_conv_kernel - 1) * el
        rec = spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim * 4
        return kv + n_lin * (conv + rec) * (1 + ring)

    def rope_rows(self, segments: list[Segment], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[rows, 1, head_dim]`` for the segments' positions in row order (``ops.apply_rope``); rows past
        the segments' (batch-invariant padding) get position 0's.

        They are rows of a table of every position up to the furthest one asked for so far (grown by doubling, at
        most ``max_position_embeddings``): a step takes a slice of it (one session) or gathers its rows.
        """
        end = max(s.start + s.length for s in segments)
        if self._rope is None or self._rope.shape[1] < end:
            size = max(end, 2 * (0 if self._rope is None else self._rope.shape[1]), 256)
            self._rope = rope_tables(self.inv_freq, self.spec.head_dim,
                                     min(size, self.spec.max_position_embeddings), self.dtype)
        if len(segments) == 1 and segments[0].length == rows:
            table = self._rope.narrow(1, segments[0].start, rows)
        else:
            table = self._rope[:, pad_rows(_positions(segments), self.min_rows).to(self.device)]
        return table[0], table[1]

    # ---- compute -------------------------------------------------------------------------------------------
    def check_input(self, step: StepInput) -> None:
        """Everything that makes one session's step invalid here, before any state changes: its positions
        (:meth:`~sangama_p2p.positions.SessionPositions.check`), token ids on the first stage, hidden states of the
        model's width on the others (token ids are checked over the whole batch: :meth:`check_token_ids`). ``forward``
        checks every step; the stage's scheduler asks first, job by job, so that a bad step fails alone."""
        if self.is_first:
            if step.tokens is None:
                raise SessionStateError("the first stage needs token ids")
        elif step.hidden is None:
            raise SessionStateError("a middle or last stage needs hidden states")
        step.state.window.check(step.start, step.length)
        if step.hidden is not None and step.hidden.shape[-1] != self.spec.hidden_size:
            raise SessionStateError(f"hidden size {step.hidden.shape[-1]} != model's {self.spec.hidden_size}")

    def check_token_ids(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Token ids must lie in 0..vocab_size-1 (the stage server asks on receipt, ``forward`` before embedding)."""
        lo, hi = (int(ids.min()), int(ids.max())) if isinstance(ids, torch.Tensor) else (min(ids), max(ids))
        if lo < 0 or hi >= self.spec.vocab_size:
            raise SessionStateError(f"token id out of range 0..{self.spec.vocab_size - 1}")

    @torch.inference_mode()
    def forward(self, steps: Sequence[StepInput]) -> torch.Tensor:
        """Run one batched step; returns the new hidden states ``[N, hidden]`` (pre final norm), rows in order.

        Each step's start position rolls its session back if the session is ahead of it.
        """
        if not steps:
            raise SessionStateError("empty batch")
        seen: set[int] = set()
        for st in steps:
            if id(st.state) in seen:
                raise SessionStateError("a session appears twice in one batched step")
            seen.add(id(st.state))
            self.check_input(st)
        ids = torch.cat([st.tokens for st in steps]) if self.is_first else None  # type: ignore[misc]
        if ids is not None:
            self.check_token_ids(ids)
        for st in steps:
            st.state.roll_back(st.start)
        if ids is not None:
            x = self.embed_rows(ids.to(self.device))
        else:
            x = torch.cat([st.hidden for st in steps]).to(self.device, self.dtype)  # type: ignore[misc]
        segments = [Segment(st.state, st.start, st.length) for st in steps]
        n = x.shape[0]
        x = pad_rows(x, self.min_rows)
        cos, sin = self.rope_rows(segments, x.shape[0])  # batch-invariant mode: whole-step tensors get a fixed row granularity
        token = MIN_ROWS.set(self.min_rows)
        try:
            for layer in self.layers.values():
                x = layer.forward(x, segments, cos, sin)
        finally:
            MIN_ROWS.reset(token)
        x = x[:n]
        for s in segments:
            s.state.window.advance(s.start, s.length)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + head (last stage only): ``[N, hidden]`` -> ``[N, vocab]`` fp32."""
        return self.head_logits(self.final_normed(hidden))

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for token ids; a quantized table dequantizes only the rows asked for."""
        if self.embed is None:
            raise ModelError("this stage holds no embedding")
        if isinstance(self.embed, torch.Tensor):
            return torch.nn.functional.embedding(ids, self.embed).to(self.dtype)
        take_rows = getattr(self.embed, "take_rows", None)
        if take_rows is not None:
            return take_rows(ids, self.dtype)
        return torch.nn.functional.embedding(ids, dense(self.embed, self.dtype))

    def final_normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of ``hidden`` in float32, whatever the stage's dtype (the logits are float32)."""
        if not self.is_last:
            raise ModelError("only the last stage holds the final norm and head")
        return rms_norm(hidden.float(), self.final_norm.float(), self.spec.rms_norm_eps)  # type: ignore[union-attr]

    @torch.inference_mode()
    def head_logits(self, normed: torch.Tensor, spans: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[N, V]`` of the normed rows ``[N, hidden]``: the kernel's product, with every score
        that can decide a token recomputed in float32 (model/head.py). ``spans`` [N]: for sampled rows, how far
        below the top (in logits) scores are recomputed (``SPAN_NATS * temperature``; 0 or None: greedy)."""
        token = MIN_ROWS.set(self.min_rows)
        try:
            coarse = linear(normed.to(self.dtype), self.head)[: normed.shape[0]].float()  # type: ignore[arg-type]
        finally:
            MIN_ROWS.reset(token)
        if self.exact_head is None:
            return coarse
        return self.exact_head.logits(normed.float(), coarse, spans)

    @torch.inference_mode()
    def mtp_forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Run the MTP layer over rows (see model/mtp.py); its KV is the session's layer ``MTP_KEY``."""
        if self.mtp is None:
            raise ModelError("this stage has no MTP layer (not the last stage, or the checkpoint has none)")
        n, m = hidden.shape[0], self.min_rows
        emb = self.embed_rows(next_tokens.to(self.device))
        cos, sin = self.rope_rows(segments, -(-n // m) * m if m else n)
        token = MIN_ROWS.set(m)
        try:
            return self.mtp.forward(pad_rows(hidden, m), pad_rows(emb, m), segments, cos, sin)[:n]
        finally:
            MIN_ROWS.reset(token)


def _positions(segments: list[Segment]) -> torch.Tensor:
    """Absolute positions of a batched step's rows, in row order."""
    return torch.tensor([p for s in segments for p in range(s.start, s.start + s.length)])


def _settle(weights: Iterable[Weight]) -> None:
    for w in weights:
        if isinstance(w, FusedWeight):
            w.settle()
