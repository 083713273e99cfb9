"""Numeric building blocks against their plain references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sangama_p2p.model import ops
from sangama_p2p.model.ops import (apply_rope, delta_rule_chunked, delta_rule_one, delta_rule_short, delta_rule_steps,
                                   rope_tables, rotate_half_index)


def _delta_inputs(bsz: int, t: int, seed: int, heads: int = 4, dk: int = 16, dv: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(bsz, t, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(bsz, t, heads, dk, generator=g), dim=-1)
    v = torch.randn(bsz, t, heads, dv, generator=g)
    log_decay = -3.0 * torch.rand(bsz, t, heads, generator=g)
    beta = torch.rand(bsz, t, heads, generator=g)
    state = torch.randn(bsz, heads, dk, dv, generator=g)
    return q, k, v, log_decay, beta, state


@pytest.mark.parametrize("bsz", [1, 2, 3])
@pytest.mark.parametrize("t", range(1, 9))
def test_delta_rule_short_equals_the_position_loop(bsz, t):
    """Closed-form states and outputs of a short step equal the loop's; ring slots and state are written in place."""
    q, k, v, log_decay, beta, state = _delta_inputs(bsz, t, seed=10 * bsz + t)
    ref_state, ref_keep = state.clone(), torch.zeros(bsz, t, *state.shape[1:])
    ref_out = delta_rule_steps(q, k, v, log_decay.exp(), beta, ref_state, ref_keep)
    keep = torch.full((bsz, t, *state.shape[1:]), float("nan"))
    state_ptr, keep_ptr = state.data_ptr(), keep.data_ptr()
    out = delta_rule_short(q, k, v, log_decay, beta, state, keep)
    assert state.data_ptr() == state_ptr and keep.data_ptr() == keep_ptr
    assert out.shape == ref_out.shape == (bsz, t, q.shape[2], v.shape[-1])
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(keep, ref_keep, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bsz", [1, 2, 5])
def test_delta_rule_one_equals_the_position_loop_at_one_position(bsz):
    """The decode step's batched products: the loop's output and state, in place, to rounding."""
    q, k, v, log_decay, beta, state = _delta_inputs(bsz, 1, seed=7 + bsz, heads=8, dk=64, dv=64)
    ref_state = state.clone()
    ref_out = delta_rule_steps(q, k, v, log_decay.exp(), beta, ref_state)
    ptr = state.data_ptr()
    out = delta_rule_one(q, k, v, log_decay.exp(), beta, state)
    assert state.data_ptr() == ptr and out.shape == ref_out.shape == (bsz, 1, 8, 64)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-6)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=2e-6)


def _denormals(x: torch.Tensor) -> int:
    return int(((x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)).sum())


@pytest.mark.parametrize("scale", [3.0, 60.0])
def test_delta_rule_chunked_with_decays_far_below_floats_range_equals_the_loop(scale):
    """Prefill's chunked rule against the position loop, with log-decays of up to -``scale`` a position (the made
    MoE's reach -57: cumulated over a chunk, -1000): equal outputs and state, and no denormal in either (the CPU's
    arithmetic on them is many times slower; ops.delta_rule_chunked). The calling thread's IEEE arithmetic is back
    after the call."""
    q, k, v, _, beta, state = _delta_inputs(1, 200, seed=5, heads=4, dk=32, dv=32)
    log_decay = -scale * torch.rand(1, 200, 4, generator=torch.Generator().manual_seed(6))
    ref_state = state.clone()
    ref = delta_rule_steps(q, k, v, log_decay.exp(), beta, ref_state)
    got_state = state[0].clone()
    got = delta_rule_chunked(q[0], k[0], v[0], log_decay[0], beta[0], got_state, chunk=64)
    torch.testing.assert_close(got, ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state, ref_state[0], rtol=1e-4, atol=1e-5)
    assert _denormals(got) == _denormals(got_state) == 0
    assert float(torch.tensor([2.0**-100]) * 2.0**-40) > 0  # a denormal: the thread no longer flushes them


def test_delta_rule_chunked_runs_with_denormals_flushed(monkeypatch):
    """Inside the chunked rule the calling thread flushes denormals to zero (where the CPU can), and not after."""
    seen = []
    real = ops._chunked

    def spy(*args):  # type: ignore[no-untyped-def]
        seen.append(float(torch.tensor([2.0**-100]) * 2.0**-40))
        return real(*args)

    monkeypatch.setattr(ops, "_chunked", spy)
    q, k, v, log_decay, beta, state = _delta_inputs(1, 70, seed=7)
    delta_rule_chunked(q[0], k[0], v[0], log_decay[0], beta[0], state[0], chunk=64)
    if torch.set_flush_denormal(False):  # (False: this CPU has no such mode)
        assert seen == [0.0]
    assert float(torch.tensor([2.0**-100]) * 2.0**-40) > 0


def test_a_process_that_flushes_denormals_does_so_on_every_thread_it_starts_and_the_chunked_rule_leaves_it_so():
    """``flush_denormals_in_process`` (the console script's, before any torch work): a thread started after it
    inherits the mode (torch's intra-op threads too, which the chunked rule's products run on at 2 threads), and the
    chunked rule no longer clears it after its call. In a child process: the mode is the process's."""
    import subprocess
    import sys

    code = """
import threading, torch
from sangama_p2p.model import ops
tiny = lambda: float(torch.tensor([2.0**-100]) * 2.0**-40)
assert tiny() > 0
if not ops.flush_denormals_in_process():
    print("no FTZ on this CPU"); raise SystemExit(0)
torch.set_num_threads(2)
seen = []
t = threading.Thread(target=lambda: seen.append(tiny())); t.start(); t.join()
g = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(70, 2, 8, generator=g) for _ in range(3))
ops.delta_rule_chunked(q, k, v, -torch.rand(70, 2, generator=g), torch.rand(70, 2, generator=g),
                       torch.zeros(2, 8, 8))
print(seen, tiny())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("[0.0] 0.0", "no FTZ on this CPU"), out.stdout


def test_only_the_console_scripts_own_process_flushes_denormals(monkeypatch, tmp_path):
    """``cli.main.entry`` runs the command with ``whole_process``: the mode is set once torch is imported; a command
    run in-process by ``main`` (tests, a library user) leaves the process's mode alone (the whole suite's hypothesis
    tests refused to draw floats after an in-process command had set it)."""
    from sangama_p2p.cli import main as cli_main

    calls = []
    monkeypatch.setattr(ops, "flush_denormals_in_process", lambda: calls.append(1) or True)
    argv = ["generate", "--local", str(tmp_path / "missing"), "--prompt-ids", "1", "--max-new-tokens", "1"]
    assert cli_main.main(argv) == 2 and calls == []  # (the checkpoint is missing: a typed error, after torch)
    assert cli_main.main(argv, whole_process=True) == 2 and calls == [1]
    assert float(torch.tensor([2.0**-100]) * 2.0**-40) > 0


def test_delta_rule_short_without_ring_and_with_strong_decay():
    """No ring: only the final state is written. Decays that underflow exp() stay finite (log-space pair decays)."""
    q, k, v, log_decay, beta, state = _delta_inputs(2, 6, seed=3)
    log_decay[:, 2] = -200.0  # exp(-200) == 0 in fp32
    ref_state = state.clone()
    ref_out = delta_rule_steps(q, k, v, log_decay.exp(), beta, ref_state)
    out = delta_rule_short(q, k, v, log_decay, beta, state)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-6)


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 4), (8, 8), (32, 8)])
def test_apply_rope_tables_equal_rotate_half(head_dim, rotary_dim):
    """The table form (sign folded into sin, pass-through dims) gives the rotate-half formula's bits."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    positions = torch.tensor([0, 5, 17, 3, 99])
    table = rope_tables(inv_freq, head_dim, 100, torch.float32)[:, positions]  # [2, T, 1, D]
    x = torch.randn(len(positions), 3, head_dim, generator=torch.Generator().manual_seed(1))
    got = apply_rope(x, table[0], table[1], rotate_half_index(head_dim, rotary_dim, x.device))
    cos, sin = table[0, :, :, :rotary_dim], table[1, :, :, :rotary_dim].clone()
    half = rotary_dim // 2
    sin[..., :half].neg_()  # the plain sin
    rot = x[..., :rotary_dim]
    want = torch.cat((rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin, x[..., rotary_dim:]),
                     dim=-1)
    assert torch.equal(got, want)
    freqs = positions[:, None].float() * inv_freq
    torch.testing.assert_close(cos[:, 0], torch.cat((freqs, freqs), dim=-1).cos(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("limit_sessions", [1, 2])
def test_delta_rule_short_in_groups_of_sessions_equals_one_call(limit_sessions):
    """Over the temporary-memory bound, sessions go in groups through views: the same states, ring and outputs."""
    q, k, v, log_decay, beta, state = _delta_inputs(5, 4, seed=7)
    per_session = 2 * 4 * q.shape[2] * q.shape[3] * v.shape[-1] * 4
    ref_state, ref_keep = state.clone(), torch.zeros(5, 4, *state.shape[1:])
    ref_out = delta_rule_short(q, k, v, log_decay, beta, ref_state, ref_keep)
    keep = torch.full((5, 4, *state.shape[1:]), float("nan"))
    out = delta_rule_short(q, k, v, log_decay, beta, state, keep, max_temp_bytes=limit_sessions * per_session)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(keep, ref_keep, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-6)
