"""The checks on names and commits a Hub gives (sangama_p2p.hub.names), called directly."""

from __future__ import annotations

import pytest

from sangama_p2p.errors import DownloadError
from sangama_p2p.hub.names import check_commit, check_name, under


@pytest.mark.parametrize("name", ["config.json", "model-00001-of-00002.safetensors", "sub/dir/x.gguf", ".gitattributes",
                                  "a..b.json"])
def test_plain_repo_names_pass(name):
    assert check_name(name, "hub") == name


@pytest.mark.parametrize("name,why", [
    ("", "empty"), ("/etc/passwd", "absolute"), ("../x", "'..'"), ("a/../../x", "'..'"), ("a\\b", "backslash"),
    ("x\0.json", "NUL"), ("a//b", "empty or '.'"), ("./a", "empty or '.'"), ("a/", "empty or '.'"), (7, "not a string"),
])
def test_names_that_could_leave_a_directory_are_refused_naming_them(name, why):
    with pytest.raises(DownloadError, match=why) as info:
        check_name(name, "the test hub")
    assert repr(name) in str(info.value) and "the test hub" in str(info.value)


def test_under_refuses_a_path_through_a_link_that_leads_out(tmp_path):
    stage, outside = tmp_path / "stage", tmp_path / "outside"
    stage.mkdir()
    outside.mkdir()
    (stage / "sub").symlink_to(outside)
    assert under(stage, "x.safetensors", "t") == stage / "x.safetensors"
    with pytest.raises(DownloadError, match="leads out of"):
        under(stage, "sub/x.safetensors", "t")
    (stage / "link.gguf").symlink_to(outside / "blob")  # the last component may be a link into the cache
    assert under(stage, "link.gguf", "t") == stage / "link.gguf"


@pytest.mark.parametrize("sha", ["../../../somewhere", "0123", "0123456789ABCDEF0123456789ABCDEF01234567", None,
                                 "0123456789abcdef0123456789abcdef01234567\n"])
def test_a_commit_must_be_40_lowercase_hex_digits(sha):
    with pytest.raises(DownloadError, match="not a commit sha"):
        check_commit(sha, "hub")
    assert check_commit("0123456789abcdef0123456789abcdef01234567", "hub")
