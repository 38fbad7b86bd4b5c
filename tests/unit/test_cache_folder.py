"""The SSD tier's folder: only omlx's own files are ever read or deleted, a cache
folder overlapping a model folder is refused, model names map to distinct folders,
and what omlx writes there is private to the user."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from omlx.cache.location import check_cache_location, model_cache_dir, model_folder_name
from omlx.cache.ssd import MARKER, MARKER_NAME
from omlx.errors import SettingsError
from omlx.settings import Settings
from tests.unit.test_cache_ssd import fill, make_payload, open_store


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (relative name -> bytes)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The umask a library caller may run under: modes must not depend on it."""
    old = os.umask(0o022)
    yield
    os.umask(old)


# -- only our own files --------------------------------------------------------


PRECIOUS = b"precious bytes"


def plant_foreign_files(folder: Path, outside: Path) -> dict[str, bytes]:
    """Files an attacker (or the user) puts in the store's marked folder, none named
    the way the store names its blocks; returns the regular ones' bytes."""
    planted = {
        "weights.safetensors": b"model weights, not a KV block",
        "notes.txt": b"my notes",
        "0123456789ABCDEF.safetensors": b"upper-case hex: not a key",
        "0123456789abcdef.safetensors.bak": b"a backup",
        "0123456789abcdef.safetensors.tmp": b"no writer id: not our temp file",
    }
    for name, data in planted.items():
        (folder / name).write_bytes(data)
    (folder / "fedcba9876543210.safetensors").mkdir()  # a folder named like a block
    (outside / "precious.safetensors").write_bytes(PRECIOUS)
    (folder / "00000000deadbeef.safetensors").symlink_to(outside / "precious.safetensors")
    return planted


def test_foreign_files_survive_restart_and_clear_and_are_not_counted(tmp_path: Path) -> None:
    folder, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    keys = fill(folder, 3)
    planted = plant_foreign_files(folder, outside)
    marker = (folder / MARKER_NAME).read_bytes()
    store = open_store(folder)
    try:
        assert store.keys() == keys
        ours = sum((folder / f"{k}.safetensors").stat().st_size for k in keys)
        stats = store.stats()
        assert (stats.num_blocks, stats.total_bytes, stats.corrupt_skipped) == (3, ours, 0)
        assert store.get("00000000deadbeef") is None  # the planted symlink is no block
        store.clear()
        assert store.keys() == [] and store.stats().total_bytes == 0
    finally:
        store.close()
    # Our blocks are gone; everything else is byte-identical and in place.
    assert snapshot(folder) == planted | {MARKER_NAME: marker}
    assert (folder / "fedcba9876543210.safetensors").is_dir()
    assert (folder / "00000000deadbeef.safetensors").is_symlink()
    assert (outside / "precious.safetensors").read_bytes() == PRECIOUS


def test_a_folder_omlx_did_not_mark_is_refused_and_left_untouched(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    # Named exactly like blocks: only the missing marker tells they are not ours.
    for i in range(2):
        (folder / f"{make_payload(i).key}.safetensors").write_bytes(b"weights" * 100)
    (folder / "config.json").write_text("{}")
    before = snapshot(folder)
    with pytest.raises(SettingsError) as refused:
        open_store(folder)
    assert refused.value.param == "cache.ssd_cache_dir"
    assert "not an omlx cache folder" in refused.value.message
    assert snapshot(folder) == before


def test_a_marker_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    (folder / MARKER_NAME).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(SettingsError, match="not an omlx cache folder"):
        open_store(folder)
    assert json.loads((folder / MARKER_NAME).read_text()) == {"format": "something-else"}


def test_damaged_blocks_in_our_folder_are_removed_at_start(tmp_path: Path) -> None:
    """A block-named file failing validation inside our marked folder was written
    by us (a crash, a full disk, another model version): removing it is safe."""
    keys = fill(tmp_path, 2)
    damaged = tmp_path / f"{keys[0]}.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:50])
    store = open_store(tmp_path)
    try:
        assert store.keys() == [keys[1]] and not damaged.exists()
    finally:
        store.close()


def test_new_folder_marker_and_blocks_are_private(tmp_path: Path, loose_umask: None) -> None:
    folder = tmp_path / "cache" / "omlx-kv-v1" / "model"
    store = open_store(folder)
    try:
        assert store.put(make_payload(1)) and store.flush()
    finally:
        store.close()
    assert json.loads((folder / MARKER_NAME).read_text()) == MARKER
    assert mode(folder / MARKER_NAME) == 0o600
    assert mode(folder / f"{make_payload(1).key}.safetensors") == 0o600
    for made in (folder, folder.parent, folder.parent.parent):
        assert mode(made) == 0o700, made


# -- where the cache may live --------------------------------------------------


def settings_for(tmp_path: Path, cache_dir: Path, model_dir: Path) -> Settings:
    return Settings(
        base_path=tmp_path / "base",
        models={"model_dirs": [model_dir]},
        cache={"ssd_cache_dir": cache_dir},
    )


@pytest.mark.parametrize(
    ("cache", "relation"),
    [
        ("models", "is the model folder"),
        ("models/tiny-llama", "is inside the model folder"),
        ("models/not-yet-created/kv", "is inside the model folder"),
        (".", "contains the model folder"),
        ("link-to-models", "is the model folder"),
        ("link-to-models/sub", "is inside the model folder"),
    ],
)
def test_cache_folder_overlapping_a_model_folder_is_refused(
    tmp_path: Path, cache: str, relation: str
) -> None:
    models = tmp_path / "models"
    (models / "tiny-llama").mkdir(parents=True)
    (tmp_path / "link-to-models").symlink_to(models)
    settings = settings_for(tmp_path, tmp_path / cache, models)
    with pytest.raises(SettingsError) as refused:
        check_cache_location(settings)
    assert refused.value.param == "cache.ssd_cache_dir"
    assert "cache.ssd_cache_dir" in refused.value.message
    assert relation in refused.value.message and str(models) in refused.value.message


def test_cache_folder_beside_the_model_folder_is_accepted(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    check_cache_location(settings_for(tmp_path, tmp_path / "models-cache", models))
    check_cache_location(settings_for(tmp_path, tmp_path / "cache", models))


# -- folder names --------------------------------------------------------------


@pytest.mark.parametrize(
    "names",
    [("a/b", "a_b"), ("a/b", "a__b"), ("org/Model", "org/model"), ("x y", "x_y"), ("..", ".")],
)
def test_model_names_map_to_distinct_folders(names: tuple[str, str]) -> None:
    first, second = (model_folder_name(n) for n in names)
    # Distinct even on a case-insensitive disk (macOS).
    assert first.casefold() != second.casefold()
    for folder in (first, second):
        assert "/" not in folder and not folder.startswith(".")


def test_model_cache_dir_stays_under_the_cache_root(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, tmp_path / "cache", tmp_path / "models")
    for name in ("../../etc", "a/../../b", "/abs/path", ".."):
        folder = model_cache_dir(settings, name)
        assert folder.parent == tmp_path / "cache" / "omlx-kv-v1"


def test_a_store_folder_holding_foreign_files_leaves_the_model_in_ram(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from omlx.cache.setup import open_ssd_store

    settings = settings_for(tmp_path, tmp_path / "cache", tmp_path / "models")
    folder = model_cache_dir(settings, "tiny-llama")
    folder.mkdir(parents=True)
    (folder / f"{make_payload(0).key}.safetensors").write_bytes(b"not written by omlx")
    before = snapshot(folder)
    with caplog.at_level("WARNING"):
        assert open_ssd_store(settings, "tiny-llama", "tiny-llama@x", ("KVCache",)) is None
    assert "prefix cache for tiny-llama stays in RAM" in caplog.text
    assert "not an omlx cache folder" in caplog.text
    assert snapshot(folder) == before
