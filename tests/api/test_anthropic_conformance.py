"""What Claude Code and other Anthropic clients rely on, through the official `anthropic`
client on a live server: prompt-cache usage (message_start has the real split, cache
writes counted under cache_control), system messages, claude-* model names, and
/v1/models in Anthropic's shape."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

MODEL = "tiny-llama"
DEFAULT = "tiny-qwen3"  # models.default_model here: not the first model by name
BLOCK = 16  # small cache blocks: a long system prompt spans many
# The SDK warns about Claude model names it knows are retiring; the name is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("base"),
        tiny_models_dir,
        cache={"block_size": BLOCK},
        # "gone-*" names a model that is not served (one deleted after setup, say).
        models={
            "default_model": DEFAULT,
            "anthropic_aliases": {"claude-*": None, "gone-*": "deleted-model"},
        },
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    # No retries: a 503 or a dropped connection must show up in the test.
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def long_system(cache_control: bool) -> list[dict]:
    """A fresh system prompt of hundreds of tokens (a nonce keeps tests from sharing cache)."""
    text = f"Session {uuid.uuid4().hex}. " + " ".join(
        f"Rule {i}: answer briefly and politely." for i in range(25)
    )
    block: dict = {"type": "text", "text": text}
    if cache_control:
        block["cache_control"] = {"type": "ephemeral"}
    return [block]


ASK = [{"role": "user", "content": "What is the capital of France?"}]


def streamed_usage(client: anthropic.Anthropic, **kw) -> tuple[dict, dict]:
    """(message_start usage, message_delta usage) of one streamed message."""
    args = {"model": MODEL, "messages": ASK, "max_tokens": 3, **kw}
    events = list(client.messages.create(**args, stream=True))
    assert events[0].type == "message_start" and events[-2].type == "message_delta"
    start = events[0].message.usage.model_dump()
    end = events[-2].usage.model_dump()
    return start, end


def prompt_split(usage: dict) -> tuple[int, int, int]:
    return (
        usage["input_tokens"],
        usage["cache_read_input_tokens"],
        usage["cache_creation_input_tokens"],
    )


def test_message_start_reports_the_cached_split_of_a_repeated_prompt(
    client: anthropic.Anthropic,
) -> None:
    system = long_system(cache_control=False)
    prompt = client.messages.count_tokens(model=MODEL, messages=ASK, system=system).input_tokens
    assert prompt > 8 * BLOCK
    first_start, first_end = streamed_usage(client, system=system)
    again_start, again_end = streamed_usage(client, system=system)
    assert prompt_split(first_start) == prompt_split(first_end)
    assert prompt_split(again_start) == prompt_split(again_end)
    # The repeat is served from the cache: all but the prompt's last token.
    read = again_start["cache_read_input_tokens"]
    assert read == prompt - 1 > first_start["cache_read_input_tokens"]
    assert again_start["input_tokens"] == prompt - read == 1
    # Without cache_control nothing is reported as written.
    assert first_start["cache_creation_input_tokens"] == again_end["cache_creation_input_tokens"]
    assert first_start["cache_creation_input_tokens"] == 0
    assert first_start["input_tokens"] == prompt - first_start["cache_read_input_tokens"]
    assert again_end["output_tokens"] == 3


def test_cache_control_reports_the_tokens_written(client: anthropic.Anthropic) -> None:
    system = long_system(cache_control=True)
    prompt = client.messages.count_tokens(model=MODEL, messages=ASK, system=system).input_tokens
    start, end = streamed_usage(client, system=system)
    assert prompt_split(start) == prompt_split(end)
    new, read, written = prompt_split(start)
    assert written > 8 * BLOCK
    assert new + read + written == prompt
    # What was reported written is what the next request reads back.
    again = client.messages.create(model=MODEL, messages=ASK, system=system, max_tokens=2)
    usage = again.usage
    assert usage.cache_read_input_tokens == read + written
    assert usage.cache_creation_input_tokens == 0  # nothing new to store
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt


def test_cache_control_on_a_message_block_counts_too(client: anthropic.Anthropic) -> None:
    text = long_system(cache_control=False)[0]["text"]
    block = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
    messages = [{"role": "user", "content": [block]}]
    prompt = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    usage = client.messages.create(model=MODEL, messages=messages, max_tokens=2).usage
    assert usage.cache_creation_input_tokens > 8 * BLOCK
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert total == prompt


def test_system_messages_join_the_system_prompt_in_order(client: anthropic.Anthropic) -> None:
    first, second = f"You are terse ({uuid.uuid4().hex}).", "Answer in French."
    merged = client.messages.count_tokens(
        model=MODEL, messages=ASK, system=f"{first}\n{second}"
    ).input_tokens
    inline = [{"role": "system", "content": [{"type": "text", "text": second}]}, *ASK]
    split = client.messages.count_tokens(model=MODEL, messages=inline, system=first)
    assert split.input_tokens == merged
    # The very same prompt: the second request reads all but its last token from cache.
    client.messages.create(model=MODEL, messages=ASK, system=f"{first}\n{second}", max_tokens=2)
    usage = client.messages.create(model=MODEL, messages=inline, system=first, max_tokens=2).usage
    assert usage.cache_read_input_tokens == merged - 1


def test_claude_model_names_are_served_by_the_default_model(
    client: anthropic.Anthropic,
) -> None:
    out = client.messages.create(model="claude-sonnet-4-5", messages=ASK, max_tokens=2)
    assert out.model == DEFAULT and out.usage.output_tokens == 2
    counted = client.messages.count_tokens(model="claude-opus-4-1", messages=ASK)
    direct = client.messages.count_tokens(model=DEFAULT, messages=ASK)
    assert counted.input_tokens == direct.input_tokens


def test_without_a_default_model_claude_names_go_to_the_first_model(
    client: anthropic.Anthropic, server: Server
) -> None:
    url = server.base_url + "/admin/api/settings"
    try:
        assert httpx.put(url, json={"models": {"default_model": None}}).status_code == 200
        out = client.messages.create(model="claude-opus-4-1", messages=ASK, max_tokens=1)
        assert out.model == "slow-llama"  # the first chat model by name
    finally:
        httpx.put(url, json={"models": {"default_model": DEFAULT}})


def test_an_alias_whose_target_is_gone_is_404_naming_the_setting(
    client: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="gone-1", messages=ASK, max_tokens=2)
    message = info.value.response.json()["error"]["message"]
    assert "models.anthropic_aliases" in message and "deleted-model" in message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="gpt-4o", messages=ASK, max_tokens=2)  # no pattern


def put_aliases(server: Server, aliases: dict) -> httpx.Response:
    body = {"models": {"anthropic_aliases": aliases}}
    return httpx.put(server.base_url + "/admin/api/settings", json=body)


def test_custom_alias_set_live_through_the_admin_api(
    client: anthropic.Anthropic, server: Server
) -> None:
    aliases = {"claude-*": None, "gone-*": "deleted-model"}
    try:
        saved = put_aliases(server, {"claude-*": "", "claude-haiku-*": MODEL, "tiny-*": DEFAULT})
        assert saved.status_code == 200, saved.text
        assert "models.anthropic_aliases" in saved.json()["applied"]
        assert saved.json()["settings"]["models"]["anthropic_aliases"]["claude-*"] is None
        haiku = client.messages.create(model="claude-haiku-4-5", messages=ASK, max_tokens=2)
        assert haiku.model == MODEL  # the longer pattern wins
        sonnet = client.messages.create(model="claude-sonnet-4-5", messages=ASK, max_tokens=2)
        assert sonnet.model == DEFAULT
        # A served folder name wins over a pattern it matches.
        direct = client.messages.create(model=MODEL, messages=ASK, max_tokens=2)
        assert direct.model == MODEL
    finally:
        put_aliases(server, aliases)


def test_bad_alias_settings_are_refused_naming_the_key(server: Server) -> None:
    before = httpx.get(server.base_url + "/admin/api/settings").json()["settings"]
    for aliases, why in (({"claude-*": "no-such-model"}, "no-such-model"), ({" ": None}, "")):
        resp = put_aliases(server, aliases)
        assert resp.status_code == 400
        message = resp.json()["error"]["message"]
        assert "models.anthropic_aliases" in message and why in message
    after = httpx.get(server.base_url + "/admin/api/settings").json()["settings"]
    assert after["models"]["anthropic_aliases"] == before["models"]["anthropic_aliases"]


def test_models_list_and_retrieve_in_anthropic_shape(client: anthropic.Anthropic) -> None:
    page = client.models.list()
    ids = [m.id for m in page.data]
    assert ids == ["slow-llama", "tiny-llama", "tiny-qwen3"]
    assert page.has_more is False and page.first_id == ids[0] and page.last_id == ids[-1]
    assert all(m.type == "model" and m.display_name == m.id for m in page.data)
    assert all(m.created_at.tzinfo is not None for m in page.data)
    one = client.models.retrieve(MODEL)
    assert one.id == MODEL and one.created_at == page.data[1].created_at
    second = client.models.list(limit=1, after_id=ids[0])
    assert [m.id for m in second.data] == [ids[1]] and second.has_more is True
    assert [m.id for m in client.models.list(limit=2)] == ids  # the SDK pages on
    with pytest.raises(anthropic.NotFoundError) as info:
        client.models.retrieve("nope")
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        client.models.list(limit=0)
    error = info.value.response.json()
    assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
    assert "tiny-llama" in error["error"]["message"]  # what exists


def test_openai_clients_keep_the_openai_models_shape(server: Server) -> None:
    body = httpx.get(server.base_url + "/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["object"] == "model"
