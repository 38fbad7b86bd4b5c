"""The Ollama-compatible API through the official `ollama` client, on a live server."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import jsonschema
import mlx.core as mx
import ollama
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import aborted_count, live_server, wait_aborted

MODEL = "tiny-llama"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
# ChatML that renders tools (Hermes style) and opens a think block when asked.
TOOL_THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    '{"name": "{{ c["function"]["name"] }}", "arguments": {{ c["function"]["arguments"] }}}'
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("ollama-models")
    for name in ("tiny-llama", "tiny-qwen3", "slow-llama"):
        (root / name).symlink_to(tiny_models_dir / name, target_is_directory=True)
    thinker = root / "tool-thinker"
    shutil.copytree(tiny_models_dir / "tiny-llama", thinker)
    config = json.loads((thinker / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_THINK_TEMPLATE
    (thinker / "tokenizer_config.json").write_text(json.dumps(config))
    with live_server(
        tmp_path_factory.mktemp("ollama-base"),
        root,
        scheduler={"prefill_step_size": 64},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    # A timeout: a server that stops answering fails the test instead of hanging it.
    return ollama.Client(host=server.base_url, timeout=60)


# ---- models -----------------------------------------------------------------------------


def test_version_list_and_show(
    client: ollama.Client, server: Server, tiny_models_dir: Path
) -> None:
    assert httpx.get(server.base_url + "/api/version").json()["version"]
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {
        "tiny-llama:latest",
        "tiny-qwen3:latest",
        "slow-llama:latest",
        "tool-thinker:latest",
    }
    entry = listed["tiny-llama:latest"]
    assert entry.size > 0 and len(entry.digest) == 64 and entry.modified_at is not None
    assert entry.details.family == "llama" and entry.details.format == "safetensors"
    assert entry.details.quantization_level == "F32"  # as the tiny models are saved
    # NAME and NAME:latest are the same model.
    shown = client.show("tiny-llama")
    assert client.show("tiny-llama:latest").modelinfo == shown.modelinfo
    assert shown.modelinfo["general.architecture"] == "llama"
    weights = mx.load(str(tiny_models_dir / "tiny-llama" / "model.safetensors"))
    assert shown.modelinfo["general.parameter_count"] == sum(w.size for w in weights.values())
    assert shown.modelinfo["llama.context_length"] == 4096
    assert shown.capabilities == ["completion", "tools"]
    assert "im_start" in shown.template and "temperature" in shown.parameters
    assert "thinking" in client.show("tool-thinker").capabilities


# ---- chat and generate ------------------------------------------------------------------


def requests_counted(server: Server) -> int:
    """Inference requests on the admin dashboard."""
    return httpx.get(server.base_url + "/admin/api/stats").json()["requests"]["total"]


def test_chat_non_streamed_and_streamed_agree(client: ollama.Client, server: Server) -> None:
    options = {**GREEDY, "num_predict": 12}
    counted = requests_counted(server)
    whole = client.chat(model=MODEL, messages=ASK, options=options, stream=False)
    assert whole.done and whole.done_reason == "length"
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.model == "tiny-llama:latest"
    assert whole.eval_count == 12 and whole.prompt_eval_count > 5
    assert whole.total_duration >= whole.eval_duration > 0
    assert whole.prompt_eval_duration > 0 and whole.load_duration >= 0
    parts = list(client.chat(model=MODEL + ":latest", messages=ASK, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == 12 and parts[-1].done_reason == "length"
    assert requests_counted(server) == counted + 2  # the dashboard counts Ollama's too


def test_generate_system_and_raw(client: ollama.Client) -> None:
    options = {**GREEDY, "num_predict": 6}
    out = client.generate(model=MODEL, prompt="Paris is", options=options)
    assert out.done and out.response and out.eval_count == 6
    with_system = client.generate(
        model=MODEL, prompt="Paris is", system="Be brief.", options=options
    )
    assert with_system.prompt_eval_count > out.prompt_eval_count
    raw = client.generate(model=MODEL, prompt="Paris is", raw=True, options=options)
    assert raw.prompt_eval_count < out.prompt_eval_count  # no chat template around it
    streamed = "".join(
        p.response
        for p in client.generate(model=MODEL, prompt="Paris is", options=options, stream=True)
    )
    assert streamed == out.response


def test_options_are_honoured(client: ollama.Client) -> None:
    def gen(**options: object) -> ollama.GenerateResponse:
        return client.generate(model=MODEL, prompt="Tell me a story", options=options)

    short = gen(num_predict=3, **GREEDY)
    assert short.eval_count == 3 and short.done_reason == "length"
    assert gen(num_predict=8, **GREEDY).response == gen(num_predict=8, **GREEDY).response
    seeded = gen(num_predict=8, temperature=1.0, seed=7).response
    assert gen(num_predict=8, temperature=1.0, seed=7).response == seeded
    assert gen(num_predict=8, temperature=1.0, seed=8).response != seeded
    # A stop string ends the answer before it (and is not shown). With the prompt
    # cached, its step carries two tokens of the request: the engine once crashed here.
    full = gen(num_predict=8, **GREEDY).response
    stop = full[3:6]
    cut = gen(num_predict=8, stop=[stop], **GREEDY)
    assert cut.done_reason == "stop" and stop not in cut.response
    assert full.startswith(cut.response)
    # Unknown and unsupported Ollama options are ignored, as Ollama does.
    assert gen(num_predict=2, num_gpu=99, mirostat=0, whatever=1).eval_count == 2


def test_format_json_schema_output_validates(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["red", "green", "blue"]},
        },
        "required": ["n", "ok", "tag"],
        "additionalProperties": False,
    }
    out = client.chat(
        model=MODEL, messages=ASK, format=schema, options={**GREEDY, "num_predict": 60}
    )
    assert out.done_reason == "stop"
    jsonschema.validate(json.loads(out.message.content), schema)
    streamed = client.chat(
        model=MODEL, messages=ASK, format=schema, options={**GREEDY, "num_predict": 60}, stream=True
    )
    assert "".join(p.message.content for p in streamed) == out.message.content
    loose = client.generate(
        model=MODEL, prompt="Say it", format="json", options={"num_predict": 20}
    )
    assert loose.response.startswith("{")


def test_tool_call_round_trip(client: ollama.Client, server: Server) -> None:
    # Ollama has no tool_choice; omlx takes OpenAI's as an extension, to force the call.
    body = {
        "model": "tool-thinker",
        "messages": ASK,
        "tools": [TOOL],
        "tool_choice": "required",
        "stream": False,
        "options": {**GREEDY, "num_predict": 60},
    }
    first = ollama.ChatResponse.model_validate(
        httpx.post(server.base_url + "/api/chat", json=body, timeout=30).json()
    )
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert first.message.content == ""
    # The call and the tool's answer go back through the official client.
    history = [*ASK, first.message, {"role": "tool", "content": "21 C", "tool_name": "get_weather"}]
    follow = client.chat(
        model="tool-thinker", messages=history, tools=[TOOL], options={**GREEDY, "num_predict": 4}
    )
    assert follow.done and follow.prompt_eval_count > first.prompt_eval_count + 10
    url = server.base_url + "/api/chat"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as resp:
        streamed = [json.loads(line) for line in resp.iter_lines()]
    calls = [part["message"].get("tool_calls") for part in streamed]
    assert [c for c in calls if c] == [
        [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    ]


def test_think_goes_to_thinking_and_reaches_the_template(client: ollama.Client) -> None:
    options = {**GREEDY, "num_predict": 8}
    thought = client.chat(model="tool-thinker", messages=ASK, think=True, options=options)
    assert thought.message.thinking and thought.message.content == ""
    plain = client.chat(model="tool-thinker", messages=ASK, think=False, options=options)
    assert plain.message.thinking is None and plain.message.content
    # enable_thinking opened the think block in the prompt: two more prompt tokens or so.
    assert thought.prompt_eval_count > plain.prompt_eval_count
    parts = list(
        client.generate(model="tool-thinker", prompt="Hi", think=True, options=options, stream=True)
    )
    assert "".join(p.thinking or "" for p in parts) and not "".join(p.response for p in parts)


# ---- keep_alive and /api/ps -----------------------------------------------------------------


def _ps(client: ollama.Client) -> dict[str, ollama.ProcessResponse.Model]:
    return {m.model: m for m in client.ps().models}


def test_keep_alive_sets_expiry_and_zero_unloads(client: ollama.Client) -> None:
    client.generate(model="tiny-qwen3", prompt="Hi", keep_alive="10m", options={"num_predict": 1})
    entry = _ps(client)["tiny-qwen3:latest"]
    left = entry.expires_at - datetime.now(UTC)
    assert timedelta(minutes=9) < left <= timedelta(minutes=10)
    assert entry.size > 0 and entry.context_length == 4096
    client.generate(model="tiny-qwen3", prompt="Hi", keep_alive=-1, options={"num_predict": 1})
    assert _ps(client)["tiny-qwen3:latest"].expires_at.year > 9000
    # keep_alive=0: unloaded once the request is done.
    out = client.chat(model="tiny-qwen3", messages=ASK, keep_alive=0, options={"num_predict": 2})
    assert out.eval_count == 2
    deadline = time.monotonic() + 10
    while "tiny-qwen3:latest" in _ps(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "tiny-qwen3:latest" not in _ps(client)
    # Ollama's load / unload idiom: no prompt.
    loaded = client.generate(model="tiny-qwen3")
    assert loaded.done and loaded.done_reason == "load" and "tiny-qwen3:latest" in _ps(client)
    unloaded = client.generate(model="tiny-qwen3", keep_alive=0)
    assert unloaded.done_reason == "unload" and "tiny-qwen3:latest" not in _ps(client)


# ---- errors ---------------------------------------------------------------------------------


def test_unknown_model_is_404_naming_what_exists(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="nope:7b", messages=ASK)
    assert info.value.status_code == 404
    assert "nope:7b" in info.value.error and "tiny-llama:latest" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.show("nope")
    assert info.value.status_code == 404


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"num_predict": 1.5}}, "options.num_predict"),
        ({"options": {"num_ctx": 10**6}}, "options.num_ctx"),
        ({"keep_alive": "forever"}, "keep_alive"),
        ({"images": ["aGk="]}, "images"),
        ({"suffix": "end"}, "suffix"),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    client: ollama.Client, kwargs: dict, field: str
) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model=MODEL, prompt="Hi", **kwargs)
    assert info.value.status_code == 400 and field in info.value.error


def test_a_prompt_over_the_memory_limit_is_400(client: ollama.Client, server: Server) -> None:
    client.generate(model=MODEL, prompt="Hi", options={"num_predict": 1})  # loaded
    engine = next(e for e in server.pool.loaded() if e.name == MODEL)
    guard, before = engine.guard, engine.guard.limits
    # Room for a tiny prompt beside the model and the margin, not for the long one
    # (as in test_openai_api's preflight test).
    room = guard.baseline_bytes + before.transient_margin_bytes + 4 * 2**20
    guard.publish(dataclasses.replace(before, hard_bytes=int(room / 0.98) + 1))
    try:
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model=MODEL, messages=[{"role": "user", "content": "the cache " * 1200}])
        assert info.value.status_code == 400 and "memory limit" in info.value.error
        assert client.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}).eval_count == 2
    finally:
        guard.publish(before)


def test_unenforceable_schema_keyword_is_flagged_not_refused(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"],
    }
    body = {"model": MODEL, "messages": ASK, "format": schema, "stream": False}
    body["options"] = {**GREEDY, "num_predict": 30}
    reply = httpx.post(server.base_url + "/api/chat", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    flagged = reply.headers["x-omlx-unenforced-schema-keywords"]
    assert flagged == "uniqueItems at $.properties.tags"


def test_wrong_types_and_unsupported_routes(server: Server) -> None:
    url = server.base_url
    stream = httpx.post(url + "/api/chat", json={"model": MODEL, "messages": ASK, "stream": "no"})
    assert stream.status_code == 400 and "stream" in stream.json()["error"]
    yaml = httpx.post(
        url + "/api/generate", json={"model": MODEL, "prompt": "Hi", "format": "yaml"}
    )
    assert yaml.status_code == 400 and "format" in yaml.json()["error"]
    # A chat model on the embedding route: a 400 naming its kind (test_embeddings.py
    # covers /api/embed with an embedding model).
    embed = httpx.post(url + "/api/embed", json={"model": MODEL, "input": "hi"})
    assert embed.status_code == 400 and "is an llm model" in embed.json()["error"]
    pull = httpx.post(url + "/api/pull", json={"model": "llama3"})
    assert pull.status_code == 501 and "omlx pull" in pull.json()["error"]
    delete = httpx.request("DELETE", url + "/api/delete", json={"model": MODEL})
    assert delete.status_code == 501 and "omlx models rm" in delete.json()["error"]


def test_api_key_and_cors_as_on_v1(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    site = "http://app.example:3000"
    settings = {"api_key": "sekret-key", "cors_origins": [site]}
    with live_server(tmp_path, tiny_models_dir, server=settings, profiles=profiles_dir) as srv:
        with pytest.raises(ollama.ResponseError) as info:
            ollama.Client(host=srv.base_url).list()
        assert info.value.status_code == 401
        auth = {"Authorization": "Bearer sekret-key"}
        keyed = ollama.Client(host=srv.base_url, headers=auth)
        assert "tiny-llama:latest" in {m.model for m in keyed.list().models}
        # A site in server.cors_origins may call the Ollama routes from a browser.
        show = {"model": MODEL}
        listed = httpx.post(srv.base_url + "/api/show", json=show, headers={**auth, "Origin": site})
        assert listed.status_code == 200
        assert listed.headers["access-control-allow-origin"] == site
        other = {**auth, "Origin": "http://evil.example"}
        refused = httpx.post(srv.base_url + "/api/show", json=show, headers=other)
        assert refused.status_code == 403 and "cors_origins" in refused.json()["error"]


# ---- client disconnect --------------------------------------------------------------------

SLOW = "slow-llama"


def test_client_disconnect_mid_stream_aborts(client: ollama.Client, server: Server) -> None:
    client.generate(model=SLOW, prompt="Hi", options={"num_predict": 1})  # loaded
    before = aborted_count(server, SLOW)
    body = {"model": SLOW, "messages": ASK, "options": {**GREEDY, "num_predict": 4000}}
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as http,
        http.stream("POST", "/api/chat", json=body) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = resp.iter_lines()
        got = [json.loads(next(lines)) for _ in range(3)]
        assert not any(g["done"] for g in got)
    wait_aborted(server, SLOW, before + 1)


def test_non_streaming_client_disconnect_aborts(client: ollama.Client, server: Server) -> None:
    before = aborted_count(server, SLOW)
    body = {
        "model": SLOW,
        "prompt": "Hi",
        "stream": False,
        "options": {**GREEDY, "num_predict": 4000},
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/api/generate", json=body, timeout=0.5)
    wait_aborted(server, SLOW, before + 1)
