"""PeerConfig from TOML (the shipped peers/ configs included) and the pure ``--layers auto`` choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from sangama_p2p.errors import LayerRangeError, SangamaError
from sangama_p2p.peer import PeerConfig, choose_layers, default_model_id

PEERS = Path(__file__).resolve().parents[1] / "peers"


def test_every_shipped_config_loads() -> None:
    files = sorted(PEERS.rglob("*.toml"))
    assert len(files) >= 7
    for f in files:
        config = PeerConfig.from_toml(f)
        assert config.host.listen_addrs, f


def test_datacenter_layout_is_three_contiguous_stages_of_twenty() -> None:
    configs = [PeerConfig.from_toml(PEERS / "datacenter" / f"stage{i}.toml") for i in (1, 2, 3)]
    ranges = [(c.stage.start, c.stage.end) for c in configs]
    assert ranges == [(0, 20), (20, 40), (40, 60)]
    assert {c.layers for c in configs} == {"0:20", "20:40", "40:60"}
    for c in configs:
        assert c.stage.dtype == "bfloat16" and c.stage.wire_dtype == "bf16"
        assert c.client is not None and c.client.model_id == c.stage.model_id == "qwen3.5-moe"
        assert c.model_path == Path("/srv/models/qwen3.5-moe")
        assert c.host.announce_addrs and c.host.announce_addrs[0].startswith("/ip4/203.0.113.")
    assert len({c.host.announce_addrs for c in configs}) == 3
    assert [c.stage.lane_port for c in configs] == [4201, 4202, 4203] and all(c.stage.lanes for c in configs)


def test_local_fleet_covers_the_tiny_model() -> None:
    configs = [PeerConfig.from_toml(PEERS / "local" / f"stage{i}.toml") for i in (1, 2, 3)]
    assert [c.layers for c in configs] == ["0:3", "3:6", "6:8"]
    assert len({c.host.listen_addrs for c in configs}) == 3  # one port each on one machine


def test_relative_model_path_and_auto_layers(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[host]\nlisten_addrs = ["/ip4/127.0.0.1/tcp/0"]\n[stage]\nmodel = "models/m1"\nlayers = "auto"\n'
                 'max_sessions = 3\n[client]\ntokenizer = "models/m1"\n')
    c = PeerConfig.from_toml(f)
    assert c.model_path == (tmp_path / "models" / "m1").resolve()
    assert c.tokenizer_path == c.model_path
    assert c.layers == "auto" and c.stage.max_sessions == 3 and c.stage.model_id == "m1"
    assert c.client.model_id == "m1"


@pytest.mark.parametrize("text, match", [
    ('[stage]\nlayers = "0:2"\n', "needs `model`"),
    ('[stage]\nmodel = "m"\nlayers = "0:2"\nbogus = 1\n', "unknown keys"),
    ('[client]\nmodel_id = "m"\nbogus = 1\n', "unknown keys"),
    ('[nope]\n', "unknown tables"),
    ('[stage\n', "cannot read"),
    ('[stage]\nmodel = "m"\nlayers = "5:2"\n', "bad layer range"),
    # a wrong type is named in TOML's terms, not as the comparison that trips on it ("'<=' not supported ...")
    ('[stage]\nmodel = "m"\nlayers = "0:2"\nmax_sessions = "many"\n', "max_sessions must be an integer, got 'many'"),
    ('[stage]\nmodel = "m"\nlayers = "0:2"\nlanes = 1\n', "lanes must be true or false, got 1"),
    ('[stage]\nmodel = "m"\nlayers = "0:2"\nmax_sessions = true\n', "max_sessions must be an integer"),
    ('[client]\nmodel_id = "m"\nstep_timeout = "x"\n', "step_timeout must be a number, got 'x'"),
])
def test_bad_configs_raise_typed_errors(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(SangamaError, match=match):
        PeerConfig.from_toml(f)


def test_whole_numbers_are_fine_where_a_number_is_expected(tmp_path: Path) -> None:
    f = tmp_path / "ok.toml"
    f.write_text('[client]\nmodel_id = "m"\nstep_timeout = 30\n')
    assert PeerConfig.from_toml(f).client.step_timeout == 30


@pytest.mark.parametrize("layers", ["auto:0", "auto:9", "auto:-1"])
def test_auto_span_outside_the_model_names_the_flag(layers: str) -> None:
    import trio

    from sangama_p2p.peer import Peer

    with pytest.raises(LayerRangeError, match=r"N in auto:N must be in 1\.\.8"):  # checked before the swarm is asked
        trio.run(Peer()._resolve_layers, layers, "m", 8)


def test_default_model_id() -> None:
    assert default_model_id("/a/b/qwen-tiny") == "qwen-tiny"
    assert default_model_id("/a/b/model-q4.gguf") == "model-q4"


def test_choose_layers_empty_swarm_takes_the_first_third() -> None:
    assert choose_layers([], 8) == (0, 3)
    assert choose_layers([], 60) == (0, 20)
    assert choose_layers([], 8, span=8) == (0, 8)


def test_choose_layers_fills_the_gap() -> None:
    assert choose_layers([(0, 20)], 60) == (20, 40)
    assert choose_layers([(0, 20), (20, 40)], 60) == (40, 60)
    assert choose_layers([(0, 20), (40, 60)], 60) == (20, 40)
    # the gap is filled from its start and never past it, so the new stage meets the next one end to start
    assert choose_layers([(0, 3), (3, 6)], 8) == (6, 8)
    assert choose_layers([(0, 3), (3, 6)], 8, span=2) == (6, 8)
    assert choose_layers([(2, 5)], 8) == (0, 2)
    assert choose_layers([(0, 3)], 8) == (3, 6)
    assert choose_layers([(0, 3)], 8, span=8) == (3, 8)
    # everything served: a spare starts at a boundary where the swarm is thinnest
    assert choose_layers([(0, 8), (0, 4)], 8, span=4) == (4, 8)
    assert choose_layers([(0, 8)], 8) == (0, 3)
    assert choose_layers([(0, 3), (3, 6), (6, 8)], 8) == (0, 3)  # the short last window is not "lighter"
    assert choose_layers([(0, 3), (3, 6), (6, 8), (0, 3)], 8) == (3, 6)


def test_choose_layers_adds_redundancy_where_thinnest() -> None:
    full = [(0, 20), (20, 40), (40, 60)]
    assert choose_layers(full + [(0, 20)], 60) == (20, 40)
    assert choose_layers(full + [(0, 20), (20, 40)], 60) == (40, 60)


def test_choose_layers_by_speed_fills_the_bottleneck_not_the_fewest_peers() -> None:
    """Issue 24, item 4: two slow peers on 0:4 (10 steps/s each) serve less than one fast peer on 4:8 (1000): a
    new peer joins 0:4, where counting peers would have sent it to 4:8."""
    covered = [(0, 4), (0, 4), (4, 8)]
    assert choose_layers(covered, 8, span=4) == (4, 8)  # by count
    assert choose_layers(covered, 8, span=4, speeds=[10.0, 10.0, 1000.0]) == (0, 4)  # by speed
    assert choose_layers(covered, 8, span=4, speeds=[10.0, 10.0, 15.0]) == (4, 8)  # 15 < 20
    # speeds within 2x count as equal (announced speeds are noisy): then the peer counts, then the lowest start
    assert choose_layers([(0, 3), (3, 6), (6, 8)], 8, speeds=[300.0, 180.0, 250.0]) == (0, 3)
    assert choose_layers([(0, 3), (3, 6), (6, 8)], 8, speeds=[300.0, 80.0, 250.0]) == (3, 6)
    # a peer that has not measured its speed yet counts as the (lower) median of the others
    assert choose_layers(covered, 8, span=4, speeds=[0.0, 10.0, 1000.0]) == (0, 4)
    assert choose_layers([(0, 3)], 8, speeds=[5.0]) == (3, 6)  # a gap still comes first


def test_the_auto_span_is_what_fits_in_memory(tmp_path: Path) -> None:
    from sangama_p2p.model import memory

    assert memory.span_that_fits([10, 10, 10, 10], None) == 4
    assert memory.span_that_fits([10, 10, 10, 10], 35) == 2  # 35 / 1.6 holds 2 layers of 10
    assert memory.span_that_fits([10, 30, 10, 10, 10], 50) == 3  # the longest run that fits: the last three
    assert memory.span_that_fits([10, 10], 5) == 0
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n")
    assert memory.available_bytes(meminfo=info) == int(0.8 * 1000 * 1024)
    assert memory.available_bytes(meminfo=tmp_path / "none") is None


def test_auto_span_of_a_real_checkpoint_is_a_third_or_what_fits(monkeypatch: pytest.MonkeyPatch,
                                                                 smollm2_gguf: Path) -> None:
    from sangama_p2p.model import memory
    from sangama_p2p.model.checkpoint import open_checkpoint

    ckpt = open_checkpoint(smollm2_gguf, tokenizer=False)
    per_layer = memory.layer_bytes(ckpt.spec, ckpt.source)
    assert len(per_layer) == 30 and min(per_layer) > 0
    assert memory.auto_span(ckpt) == 10  # this machine holds a third of SmolLM2 easily
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": int(4.5 * per_layer[0] * memory.OVERHEAD))
    assert memory.auto_span(ckpt) == 4
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1000)
    with pytest.raises(LayerRangeError, match="not one layer of this model fits"):
        memory.auto_span(ckpt)


@pytest.mark.parametrize("span", [0, 9, -1])
def test_choose_layers_rejects_bad_span(span: int) -> None:
    with pytest.raises(LayerRangeError):
        choose_layers([], 8, span=span)


def test_network_generate_needs_a_model_and_a_bootstrap_address(capsys: pytest.CaptureFixture[str]) -> None:
    from sangama_p2p.cli.main import main

    assert main(["generate", "--prompt-ids", "1,2", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/"
                 "12D3KooWKvVTzQZ5gKwzBq5rQxBdYDu1d3GLwX2ZJgzyvg4cbyzY"]) == 2
    assert "--model" in capsys.readouterr().err
    from sangama_p2p.cli.net_cmds import default_bootstrap_addrs

    if not default_bootstrap_addrs():  # while the public list is empty, a client must be told where to start
        assert main(["generate", "--model", "m", "--prompt-ids", "1,2"]) == 2
        assert "no bootstrap address" in capsys.readouterr().err


def test_stage_fused_switch(tmp_path: Path) -> None:
    """``[stage] fused = false`` keeps GGUF weights on the dequantize-per-use path; the default repacks them."""
    path = tmp_path / "p.toml"
    path.write_text('[stage]\nmodel = "m"\nlayers = "0:2"\nfused = false\n')
    assert PeerConfig.from_toml(path).stage.fused is False
    path.write_text('[stage]\nmodel = "m"\nlayers = "0:2"\n')
    assert PeerConfig.from_toml(path).stage.fused is True
    path.write_text('[stage]\nmodel = "m"\nlayers = "0:2"\nfused = 3\n')
    with pytest.raises(SangamaError, match="fused must be true or false"):
        PeerConfig.from_toml(path)


@pytest.mark.parametrize("value, match", [('"x"', "verify must be a fraction"), ("1.5", "verify must be a fraction"),
                                          ("true", "verify must be a fraction")])
def test_client_verify_is_a_fraction_of_trips(tmp_path: Path, value: str, match: str) -> None:
    f = tmp_path / "v.toml"
    f.write_text(f'[client]\nmodel_id = "m"\nverify = {value}\n')
    with pytest.raises(SangamaError, match=match):
        PeerConfig.from_toml(f)
    f.write_text('[client]\nmodel_id = "m"\nverify = 0.2\nbans_file = "~/b.json"\nban_s = 60\n')
    c = PeerConfig.from_toml(f).client
    assert (c.verify, c.bans_file, c.ban_s) == (0.2, Path("~/b.json").expanduser(), 60)
    f.write_text('[client]\nmodel_id = "m"\nverify = 0\n')
    assert PeerConfig.from_toml(f).client.verify == 0
