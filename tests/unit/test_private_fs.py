"""omlx's data folder is made private at start, but never the user's home folder."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from omlx.private_fs import make_private_dir, tighten_base_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "home"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    monkeypatch.setenv("HOME", str(folder))
    return folder


def test_a_loose_base_folder_is_tightened(home: Path) -> None:
    base = home / ".omlx"
    base.mkdir()
    base.chmod(0o755)
    assert tighten_base_dir(base) == 0o755
    assert mode(base) == 0o700
    assert tighten_base_dir(base) is None  # already private: nothing to do


@pytest.mark.parametrize("pick", [lambda home: home, lambda home: home.parent])
def test_the_home_folder_and_its_parents_are_never_changed(home: Path, pick) -> None:
    chosen = pick(home)
    before = mode(chosen)
    assert tighten_base_dir(chosen) is None
    assert mode(chosen) == before


def test_missing_parents_are_created_private(tmp_path: Path) -> None:
    made = make_private_dir(tmp_path / "a" / "b" / "c")
    assert [mode(p) for p in (made, made.parent, made.parent.parent)] == [0o700] * 3
    assert make_private_dir(made) == made  # an existing folder is fine
