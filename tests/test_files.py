"""wmrl_jax.files: a failing writer leaves the previous file and no temporary; a folder swap is whole."""

import pytest

from wmrl_jax import files


def test_write_atomic_keeps_suffix_and_replaces(tmp_path):
    seen = []
    path = files.write_atomic(tmp_path / "sub" / "a.json", lambda tmp: (seen.append(tmp.suffix), tmp.write_text("1")))
    assert path.read_text() == "1" and seen == [".json"]
    files.write_text_atomic(path, "2")
    assert path.read_text() == "2"
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_write_atomic_failure_leaves_previous_and_no_temporary(tmp_path):
    path = files.write_text_atomic(tmp_path / "a.txt", "old")

    def half(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed"):
        files.write_atomic(path, half)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_swap_into_place(tmp_path):
    out = tmp_path / "model"
    for version in ("v1", "v2"):
        staging = tmp_path / "model.staging"
        staging.mkdir()
        (staging / "w").write_text(version)
        assert files.swap_into_place(staging, out) == out
        assert (out / "w").read_text() == version and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]   # the .old copy removed
