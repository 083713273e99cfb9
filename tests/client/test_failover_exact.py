"""A kill -9 of a running stage changes nothing in a greedy generation: the replay re-sends every trip in its
original shape, so the spare's caches hold the dead stage's numbers bit for bit (real SmolLM2 stage processes)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from .failover_fleet import READY_PREFIX, run_kills, start_fleet  # noqa: F401 (READY_PREFIX: the ready line)

pytestmark = pytest.mark.slow


def test_kill_9_of_the_middle_stage_at_random_tokens_gives_the_uninterrupted_tokens(smollm2_gguf: Path,
                                                                                    tmp_path: Path) -> None:
    from sangama_p2p.model.checkpoint import open_checkpoint

    tok = open_checkpoint(smollm2_gguf).tokenizer
    prompt = tok.encode("The history of the city of Paris begins with a small settlement on an island in the river")
    fleet = start_fleet(smollm2_gguf, ["0:10", "10:20", "20:30"], "10:20", tmp_path)
    try:
        model_id = next(line for line in fleet.children[1].seen if line.startswith(READY_PREFIX)).split()[2]
        kills = random.Random(22).sample(range(3, 56), 2)
        runs = run_kills(fleet, model_id, prompt, 60, kills)
    finally:
        fleet.stop()
    base, *killed = runs
    assert len(base.tokens) == 60 and base.failovers == 0
    for run in killed:
        assert run.failovers >= 1 and run.replay_exact, run
        assert run.replayed_trips >= run.kill_at, run
        assert run.tokens == base.tokens, f"killed after token {run.kill_at}: diverged"
