"""The position arithmetic and rollback ring of a session (``positions.py``): pure, no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sangama_p2p
from sangama_p2p.errors import CapacityError, SessionStateError
from sangama_p2p.positions import (
    SessionPositions, guess_room, is_decode_step, kept, mtp_keep, next_start, ring_size, session_length, step_guesses,
)


def test_step_arithmetic():
    assert ring_size(0) == 0 and ring_size(4) == 5
    assert session_length(10, 20, 4) == 35
    assert step_guesses([7, 1, 2, 3], 3) == (1, 2, 3) and step_guesses([7], 0) == ()
    assert is_decode_step(4, 3) and not is_decode_step(5, 3)
    # a decode step [new, g1, g2, g3] at 10 that keeps 2 guesses: positions 10..12 stay, the next starts at 13
    assert kept(4, 3, 2) == 3 and next_start(10, 4, 3, 2) == 13
    assert next_start(0, 6, 0, 0) == 6  # a prefill of 6 tokens
    assert guess_room(16, 10) == 5


def test_mtp_keep():
    assert mtp_keep(10, 3, 13) == (10, 3)  # continues: everything stays
    assert mtp_keep(10, 3, 11) == (10, 1)  # into the held-back rows
    assert mtp_keep(10, 3, 8) == (8, 0)  # behind the MTP layer's own positions
    with pytest.raises(SessionStateError, match="holds 13 positions"):
        mtp_keep(10, 3, 14)


def test_attention_only_rolls_back_anywhere_behind():
    p = SessionPositions(capacity=16)
    p.advance(0, 6)
    assert p.position == 6 and p.ring_len == 0
    assert p.roll_back(2) is None and p.position == 2
    with pytest.raises(SessionStateError, match="ahead of the session"):
        p.check(3, 1)
    with pytest.raises(CapacityError):
        p.check(2, 15)
    with pytest.raises(SessionStateError):
        p.check(-1, 1)
    with pytest.raises(SessionStateError):
        p.check(0, 0)


def test_recurrent_ring_keeps_the_states_after_the_last_positions_of_multi_token_steps():
    p = SessionPositions(capacity=32, ring=5, recurrent=True)
    p.advance(0, 8)  # a prefill longer than the ring keeps no snapshot
    assert not p.keeps_ring(8) and p.ring_len == 0
    with pytest.raises(SessionStateError, match="the last 0 positions"):
        p.check(7, 1)
    assert p.keeps_ring(4) and not p.keeps_ring(1) and not p.keeps_ring(6)
    assert p.ring_offset(8, 4) == 3  # the state after position p goes to slot p % 5
    p.advance(8, 4)  # a verify step [new, g1, g2, g3] over 8..11: snapshots after 8, 9, 10, 11
    assert p.ring_len == 4
    assert p.can_roll_back_to(9) and p.can_roll_back_to(12) and not p.can_roll_back_to(8)
    assert p.roll_back(10) == 4  # the state after position 9 is in slot 9 % 5
    assert p.position == 10 and p.ring_len == 2  # snapshots after 10 are stale now
    assert not p.can_roll_back_to(11) and p.can_roll_back_to(9)
    p.advance(10, 1)  # a one-token step keeps nothing
    assert p.ring_len == 0 and not p.can_roll_back_to(10)


def test_a_ring_for_two_windows_covers_two_verify_steps_back_to_back():
    """Several windows in flight (issue 29): a step that continues the last one adds its snapshots to the ring, so
    that a window cut short takes every stage back into the window before it, and the trip after that window and
    the window ahead of it can again be taken back into."""
    p = SessionPositions(capacity=64, ring=ring_size(2, windows=2), recurrent=True)
    assert p.ring == 6 and p.fits_guesses(2, windows=2) and not p.fits_guesses(2, windows=3)
    p.advance(0, 10)
    p.advance(10, 3)  # window 1: snapshots after 10, 11, 12
    p.advance(13, 3)  # window 2 right after it: after 13, 14, 15
    assert p.ring_len == 6 and p.can_roll_back_to(11) and not p.can_roll_back_to(10)
    assert p.roll_back(12) == 11 % 6  # window 2 did not stand, nor window 1's last guess: back to after 11
    assert p.ring_len == 2
    p.advance(12, 3)  # the trip after window 1 (after 12, 13, 14)
    p.advance(15, 3)  # and the window ahead of it (after 15, 16, 17): slots wrap round the ring's end
    assert p.ring_len == 6 and p.can_roll_back_to(13) and not p.can_roll_back_to(12)
    assert p.roll_back(14) == 13 % 6
    one = SessionPositions(capacity=64, ring=ring_size(2), recurrent=True)  # one window
    one.advance(10, 3)
    one.advance(13, 3)
    assert one.ring_len == 3 and not one.can_roll_back_to(13) and one.can_roll_back_to(14)


def test_fits_guesses():
    assert SessionPositions(8, ring=5, recurrent=True).fits_guesses(4)
    assert not SessionPositions(8, ring=4, recurrent=True).fits_guesses(4)
    assert SessionPositions(8, ring=0).fits_guesses(4)  # attention rolls back by position


def test_positions_and_the_loop_load_no_torch():
    script = ("import sys, sangama_p2p.positions, sangama_p2p.generation\n"
              "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_positions_and_the_loop_import_only_the_package_root():
    """They sit beside guesses.py so that client/ (no torch), stage/ and model/ can all import them."""
    root = Path(sangama_p2p.__file__).parent
    for name in ("positions.py", "generation.py"):
        tree = ast.parse((root / name).read_text())
        project = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        assert set(project) <= {"errors", "positions", "clock"}, (name, project)
