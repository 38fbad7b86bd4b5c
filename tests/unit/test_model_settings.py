"""Per-model settings: the store's file, validation, aliases, default model, and priority."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from omlx.errors import SettingsError
from omlx.models.model_settings import (
    KVQuantSpec,
    ModelSettings,
    ModelSettingsStore,
    effective_context_window,
    effective_template_kwargs,
    request_defaults,
)
from omlx.settings import Settings


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "model_settings.json"


@pytest.fixture
def store(path: Path) -> ModelSettingsStore:
    return ModelSettingsStore(path)


# ---- persistence ------------------------------------------------------------------------


def test_missing_file_is_empty_and_unknown_models_inherit_everything(store, path):
    assert store.all() == {}
    assert store.get("anything") == ModelSettings()
    assert store.default_model() is None
    assert not path.exists()


def test_settings_survive_a_new_store(store, path):
    store.put(
        "qwen3-8b",
        {
            "alias": "qwen",
            "temperature": 0.6,
            "pinned": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )

    again = ModelSettingsStore(path).get("qwen3-8b")

    assert again.alias == "qwen"
    assert again.temperature == 0.6
    assert again.pinned is True
    assert again.chat_template_kwargs == {"enable_thinking": False}
    assert again.top_p is None


def test_the_file_holds_only_overrides(store, path):
    store.put("m", {"top_k": 40})

    assert json.loads(path.read_text()) == {"m": {"top_k": 40}}


def test_update_merges_and_none_clears_a_field(store, path):
    store.put("m", {"temperature": 0.5, "top_k": 20})

    store.update("m", {"top_p": 0.9, "top_k": None})

    again = ModelSettingsStore(path).get("m")
    assert (again.temperature, again.top_p, again.top_k) == (0.5, 0.9, None)


def test_put_replaces_all_fields(store):
    store.put("m", {"temperature": 0.5})

    store.put("m", {"top_k": 5})

    assert store.get("m").temperature is None
    assert store.get("m").top_k == 5


def test_reset_forgets_a_model(store, path):
    store.put("m", {"temperature": 0.5})
    store.put("other", {"top_k": 5})

    store.reset("m")

    assert set(ModelSettingsStore(path).all()) == {"other"}
    assert store.get("m") == ModelSettings()


# ---- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11.0),
        ("ttl_s", 0),
        ("max_context_window", 8),
        ("max_tokens", 0),
        ("kv_bits", 5),
        ("kv_bits", "8"),
        ("kv_group_size", 48),
        ("quantized_kv_start", -1),
        ("quantized_kv_start", 1.5),
        ("quantized_kv_start", "16"),
        ("model_type", "diffusion"),
        ("trust_remote_code", "yes"),
        ("trust_remote_code", 1),
        ("alias", ""),
        ("alias", "/qwen"),
        ("alias", "my model"),
        ("alias", "x" * 129),
        ("no_such_setting", 1),
    ],
)
def test_invalid_values_raise_naming_the_field(store, path, field, value):
    with pytest.raises(SettingsError) as caught:
        store.put("m", {field: value})

    assert caught.value.message.startswith(f"{field}: ")
    assert caught.value.param == field
    assert store.get("m") == ModelSettings()
    assert not path.exists()


def test_kv_bits_names_the_values_it_takes(store):
    with pytest.raises(SettingsError, match=r"^kv_bits: Input should be 4 or 8 \(got 16\)"):
        store.put("m", {"kv_bits": 16})
    with pytest.raises(SettingsError, match=r"^kv_group_size: Input should be 32, 64 or 128"):
        store.put("m", {"kv_bits": 8, "kv_group_size": 16})


def test_kv_quantization_is_off_by_default_and_groups_default_to_32(store, path):
    """32: the group that meets issue 41's drift bar on the built-in model
    (model_settings.DEFAULT_KV_GROUP_SIZE)."""
    assert store.get("m").kv_quant is None
    store.put("m", {"kv_bits": 4})
    assert ModelSettingsStore(path).get("m").kv_quant == KVQuantSpec(bits=4, group_size=32)
    store.update("m", {"kv_group_size": 64})
    assert store.get("m").kv_quant == KVQuantSpec(bits=4, group_size=64)
    store.update("m", {"kv_bits": None})
    assert store.get("m").kv_quant is None


def test_quantized_kv_start_is_kept_beside_kv_bits_and_defaults_to_0(store, path):
    """mlx-lm's quantized_kv_start: None (the default) is 0, quantized from the first
    token; a whole number of tokens, never negative or fractional."""
    store.put("m", {"kv_bits": 8, "quantized_kv_start": 4096})
    assert ModelSettingsStore(path).get("m").kv_quant == KVQuantSpec(8, 32, 4096)
    store.update("m", {"quantized_kv_start": None})
    assert store.get("m").kv_quant == KVQuantSpec(8, 32, 0)
    with pytest.raises(SettingsError, match=r"^quantized_kv_start: Input should be greater"):
        store.update("m", {"quantized_kv_start": -16})
    with pytest.raises(SettingsError, match=r"^quantized_kv_start: Input should be a valid int"):
        store.update("m", {"quantized_kv_start": 16.0})


def test_trust_remote_code_is_off_until_set_and_kept_in_the_file(store, path):
    assert store.get("m").trust_remote_code is False
    store.update("m", {"trust_remote_code": True})
    assert json.loads(path.read_text())["m"] == {"trust_remote_code": True}
    assert ModelSettingsStore(path).get("m").trust_remote_code is True
    store.update("m", {"trust_remote_code": False})
    assert ModelSettingsStore(path).get("m").trust_remote_code is False


def test_a_failed_update_keeps_the_old_settings(store):
    store.put("m", {"temperature": 0.5})

    with pytest.raises(SettingsError, match=r"^temperature: "):
        store.update("m", {"temperature": 3})

    assert store.get("m").temperature == 0.5


def test_model_type_accepts_the_discovered_kinds(store):
    for kind in ("llm", "vlm", "embedding", "rerank"):
        assert store.put("m", {"model_type": kind}).model_type == kind


# ---- aliases ----------------------------------------------------------------------------


def test_resolve_by_folder_name_and_by_alias(store):
    store.put("Qwen3-8B-4bit", {"alias": "qwen"})
    available = ["Qwen3-8B-4bit", "llama"]

    assert store.resolve("Qwen3-8B-4bit", available) == "Qwen3-8B-4bit"
    assert store.resolve("qwen", available) == "Qwen3-8B-4bit"
    assert store.resolve("llama", available) == "llama"
    assert store.resolve("mistral", available) is None
    assert store.alias_of("Qwen3-8B-4bit") == "qwen"
    assert store.alias_of("llama") == "llama"


def test_alias_of_a_model_that_is_gone_resolves_to_nothing(store):
    store.put("removed", {"alias": "old"})

    assert store.resolve("old", ["other"]) is None


def test_folder_name_wins_over_a_clashing_alias(store):
    # The alias was set before a folder with that name appeared.
    store.put("big", {"alias": "small"})

    assert store.resolve("small", ["big", "small"]) == "small"


def test_alias_must_be_unique(store):
    store.put("a", {"alias": "fast"})

    with pytest.raises(SettingsError, match=r"^alias: .*'a'") as caught:
        store.put("b", {"alias": "fast"})

    assert caught.value.param == "alias"
    assert store.get("b").alias is None
    store.put("a", {"alias": "fast", "top_k": 1})  # re-saving its own alias is fine


def test_alias_must_not_be_another_models_folder_name(store):
    with pytest.raises(SettingsError, match=r"^alias: "):
        store.put("a", {"alias": "b"}, available=["a", "b"])
    store.put("b", {"top_k": 1})
    with pytest.raises(SettingsError, match=r"^alias: "):
        store.put("a", {"alias": "b"})

    assert store.put("a", {"alias": "a"}, available=["a", "b"]).alias == "a"


# ---- default model ----------------------------------------------------------------------


def test_only_one_model_is_the_default(store, path):
    store.put("a", {"is_default": True, "top_k": 3})
    store.put("b", {"is_default": True})

    assert store.default_model() == "b"
    assert store.get("a").is_default is False
    assert store.get("a").top_k == 3
    assert ModelSettingsStore(path).default_model() == "b"


def test_clearing_the_default_leaves_none(store):
    store.put("a", {"is_default": True})

    store.update("a", {"is_default": False})

    assert store.default_model() is None


# ---- corrupt file -----------------------------------------------------------------------


def test_corrupt_json_is_set_aside_and_the_store_starts_empty(path, caplog):
    path.write_text("{not json", encoding="utf-8")

    with caplog.at_level(logging.ERROR, logger="omlx.models.model_settings"):
        store = ModelSettingsStore(path)

    assert store.all() == {}
    copies = list(path.parent.glob("model_settings.json.corrupt-*"))
    assert [c.read_text() for c in copies] == ["{not json"]
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    store.put("m", {"top_k": 1})
    assert ModelSettingsStore(path).get("m").top_k == 1


def test_a_non_object_file_is_set_aside(path):
    path.write_text("[1, 2]", encoding="utf-8")

    assert ModelSettingsStore(path).all() == {}
    assert len(list(path.parent.glob("model_settings.json.corrupt-*"))) == 1


def test_invalid_entries_are_dropped_and_valid_ones_kept(path, caplog):
    data = {"good": {"top_k": 4}, "bad": {"temperature": 9}, "worse": "nope"}
    path.write_text(json.dumps(data), encoding="utf-8")

    with caplog.at_level(logging.ERROR, logger="omlx.models.model_settings"):
        store = ModelSettingsStore(path)

    assert set(store.all()) == {"good"}
    assert store.get("good").top_k == 4
    (copy,) = path.parent.glob("model_settings.json.corrupt-*")
    assert json.loads(copy.read_text()) == data
    assert "temperature" in caplog.text


def test_a_hand_edited_file_cannot_break_the_invariants(path):
    data = {
        "a": {"alias": "x", "is_default": True},
        "b": {"alias": "x", "is_default": True},
        "c": {"alias": "a"},
    }
    path.write_text(json.dumps(data), encoding="utf-8")

    store = ModelSettingsStore(path)

    assert store.default_model() == "a"
    assert store.resolve("x", ["a", "b", "c"]) == "a"
    assert store.get("b").alias is None
    assert store.get("c").alias is None


# ---- priority -------------------------------------------------------------------------


def test_model_sampling_beats_global_defaults():
    model = ModelSettings(temperature=0.6, top_k=20, max_tokens=64)

    got = request_defaults(Settings(), model)

    assert got.sampling.model_dump() == {
        "temperature": 0.6,
        "top_p": 1.0,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert got.generation.max_tokens == 64
    assert got.forced == frozenset()  # the request's own values still win


def test_forced_model_sampling_names_only_what_the_model_sets():
    model = ModelSettings(temperature=0.6, force_sampling=True)

    got = request_defaults(Settings(), model)

    assert got.forced == {"temperature"}  # the model does not set top_p: the request wins
    assert got.sampling.temperature == 0.6
    assert got.generation.max_tokens == Settings().generation.max_tokens


def test_template_kwargs_request_overrides_unlocked_keys_only(caplog):
    model = ModelSettings(
        chat_template_kwargs={"enable_thinking": False, "style": "terse"},
        locked_template_kwargs=["enable_thinking", "tools_mode"],
    )
    request = {"enable_thinking": True, "style": "verbose", "tools_mode": "x", "extra": 1}

    with caplog.at_level(logging.INFO, logger="omlx.models.model_settings"):
        got = effective_template_kwargs(request, model)

    assert got == {"enable_thinking": False, "style": "verbose", "extra": 1}
    assert "enable_thinking" in caplog.text
    assert effective_template_kwargs(None, model) == model.chat_template_kwargs


def test_limits():
    assert effective_context_window(8192, 32768, native=131072) == 8192
    assert effective_context_window(None, 32768, native=4096) == 4096
    assert effective_context_window(None, 32768) == 32768


def test_store_hands_out_values_that_cannot_change_its_state(store):
    store.put("m", {"top_k": 1, "chat_template_kwargs": {"a": 1}})

    with pytest.raises(ValueError):
        store.get("m").top_k = 2  # type: ignore[misc]
    store.get("m").chat_template_kwargs["a"] = 2
    store.all()["m"].chat_template_kwargs["a"] = 3

    assert store.get("m").top_k == 1
    assert store.get("m").chat_template_kwargs == {"a": 1}
