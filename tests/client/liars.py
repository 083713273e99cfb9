"""Lying stages for the verification tests: real stage servers whose computed outputs are changed before they go on
the wire (the scheduler's ``deliver`` is wrapped), and which announce a high throughput so that routing picks them.

``lie_constant(server, token)``: a last stage that answers ``token`` as its new token on every trip (its accepted
guesses kept, so the client's own shape checks pass). ``lie_noise(server, scale)``: a stage whose hidden states get
Gaussian noise of ``scale`` x their own standard deviation. ``when=``: an adaptive liar, lying only on the steps a
rule picks (``after_first_step``; ``beside(peer)``: colluders framing a neighbour). Both really compute, and really serve the wrong
outputs over the real wire; nothing in the client is replaced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from sangama_p2p.stage import StageServer
from sangama_p2p.tensors import from_wire, to_wire

FAST = 1e6  # steps/s announced by a liar (honest stages measure ~100-1000 on the tiny model)


def _attractive(server: StageServer) -> None:
    class Boastful(type(server)):  # the real server, announcing (and answering probes with) a high throughput
        @property
        def throughput(self) -> float:
            return FAST

    server.__class__ = Boastful


def modest(server: StageServer) -> None:
    """Make ``server`` (an honest stage) announce 1 step/s: routing then takes a liar of its range whatever RTT noise
    a loaded machine measures (a liar's boast alone once lost to 10 ms of it)."""
    server.__class__ = type("Modest", (type(server),), {"throughput": property(lambda self: 1.0)})


def lie_constant(server: StageServer, token: int, *, when: Callable[[Any], bool] | None = None) -> list[int]:
    """Make ``server`` (a last stage) answer ``token`` as every trip's new token (``when(job)``: only on the steps
    it says); returns a list that counts the trips it lied on."""
    assert server.model.is_last
    _attractive(server)
    real, lies = server.scheduler.deliver, []

    def deliver(job: Any, out: Any) -> None:
        if out.error is None and out.last is not None and (when is None or when(job)):
            tokens = (*out.last.tokens[:-1], token)
            out = dataclasses.replace(out, last=dataclasses.replace(out.last, tokens=tokens))
            lies.append(job.msg.step)
        real(job, out)

    server.scheduler.deliver = deliver
    return lies


def lie_noise(server: StageServer, scale: float, *, seed: int = 0,
              when: Callable[[Any], bool] | None = None) -> list[int]:
    """Make ``server`` (a middle stage) add noise to the hidden states it forwards (``when(job)``: only on the steps
    it says); returns its lie counter. The noise is drawn from ``seed`` and the step's number and position, so a
    replay of a trip gets the noise its live run got (a stage whose lies are consistent): drawn in turn from one
    generator, a replay's noise depended on how many trips the ring had run ahead meanwhile, and now and then left
    the replay's token the honest one - nobody could be blamed."""
    assert not server.model.is_last
    _attractive(server)
    real, lies = server.scheduler.deliver, []

    def deliver(job: Any, out: Any) -> None:
        if out.error is None and out.hidden is not None and (when is None or when(job)):
            h = from_wire(out.hidden, dtype=torch.float32)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + job.msg.step * 1009 + job.msg.start_pos)
            noisy = h + scale * h.std() * torch.randn(h.shape, generator=gen)
            out = dataclasses.replace(out, hidden=to_wire(noisy, out.hidden.dtype))
            lies.append(job.msg.step)
        real(job, out)

    server.scheduler.deliver = deliver
    return lies


def after_first_step(job: Any) -> bool:
    """An adaptive liar's rule: honest on a session's first step (its prefill), lying on every later one."""
    return job.msg.step >= 1


def beside(peer_id: str) -> Callable[[Any], bool]:
    """A colluder's rule: lie only in sessions whose next or previous stage is ``peer_id`` (a stage learns both
    from OpenSession), to get that peer blamed."""
    return lambda job: peer_id in (job.session.next_hop, job.session.upstream)
