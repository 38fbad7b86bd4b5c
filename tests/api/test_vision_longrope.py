"""LongRoPE in the decode batch (issue 41): mlx-vlm's SuScaledRoPE picks its short or
long factors from a forward's largest position, so a short row decoding beside a row
past ``original_max_position_embeddings`` would be roped by the long factors; omlx
ropes each token by its own position (models/vlm_rope.py). A tiny phi3_v (its Su-scaled
rope's short and long factors distinct) whose threshold is 48 tokens, not 4096, so a
short request stays below it and a long one passes it in a few tokens."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from omlx.api.server import Server
from omlx.engine.token_text import TokenText
from tests.fixtures.tiny_vlm_configs_phi import shallow_phi3_v_tower
from tests.fixtures.tiny_vlms import build_tiny_vlm

MODEL = "tiny-phi3-v-longrope"
THRESHOLD = 48
SHORT = "tell me a story"  # 18 prompt tokens: with its answer, below the threshold
LONG = "tell me a short story about the colours and the shapes of a garden " * 3  # 114
# mlx-vlm's generate prefills in chunks of 2048, which end on the checkpoints' 4096:
# no forward of its straddles the threshold. Chunks of 16 end on this model's 48.
REFERENCE_CHUNK = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path) -> Iterator[Server]:
    from tests.fixtures.servers import live_server

    root = tmp_path_factory.mktemp("tiny-longrope")
    with pytest.MonkeyPatch.context() as patch:
        shallow_phi3_v_tower(patch)
        folder = build_tiny_vlm(root / MODEL, "phi3_v", seed=0, image_size=336)
        config = json.loads((folder / "config.json").read_text())
        scaling = config["rope_scaling"]
        assert scaling["short_factor"] != scaling["long_factor"]
        config["original_max_position_embeddings"] = THRESHOLD
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        with live_server(
            tmp_path_factory.mktemp("base"),
            root,
            profiles=profiles_dir,
            scheduler={"max_concurrent_requests": 4},
        ) as srv:
            yield srv


@pytest.fixture(scope="module")
def client(served: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def mlx_vlm(served: Server) -> tuple[Any, Any]:
    from mlx_vlm import load

    folder = next(i.path for i in served.pool.available().values() if i.name == MODEL)
    return load(str(folder))


def reference(mlx_vlm: tuple[Any, Any], text: str, max_tokens: int) -> list[bytes]:
    """mlx-vlm's own greedy generate on the prompt the server renders, each token's bytes."""
    from mlx_vlm import stream_generate

    model, processor = mlx_vlm
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    pieces = stream_generate(
        model,
        processor,
        prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        prefill_step_size=REFERENCE_CHUNK,
    )
    spell = TokenText(processor.tokenizer)
    return [spell.piece(p.token)[1] for p in pieces if p.finish_reason is None]


def _request(text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
    }


def answer(client: openai.OpenAI, text: str, max_tokens: int) -> tuple[list[bytes], int]:
    """(each token's bytes, the prompt's tokens)."""
    reply = client.chat.completions.create(**_request(text, max_tokens))
    assert reply.usage is not None
    return [bytes(t.bytes) for t in reply.choices[0].logprobs.content], reply.usage.prompt_tokens


class Streamed(threading.Thread):
    """A streamed request read as it arrives: its tokens, when its first and last came."""

    def __init__(self, client: openai.OpenAI, text: str, max_tokens: int):
        super().__init__()
        self._stream = client.chat.completions.create(
            **_request(text, max_tokens), stream=True, stream_options={"include_usage": True}
        )
        self.tokens: list[bytes] = []
        self.prompt_tokens = 0
        self.started = threading.Event()
        self.finished_at = 0.0

    def run(self) -> None:
        for chunk in self._stream:
            if chunk.usage is not None:
                self.prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices:
                if choice.logprobs and choice.logprobs.content:
                    self.tokens += [bytes(t.bytes) for t in choice.logprobs.content]
                    self.started.set()
        self.finished_at = time.monotonic()
        self.started.set()


def test_a_short_row_beside_one_past_the_threshold_answers_as_alone_and_as_mlx_vlm(
    client: openai.OpenAI, mlx_vlm: tuple[Any, Any]
) -> None:
    short_tokens = 12
    expected = reference(mlx_vlm, SHORT, short_tokens)
    alone, short_prompt = answer(client, SHORT, short_tokens)
    assert short_prompt + short_tokens < THRESHOLD
    assert alone == expected
    # The long row decodes throughout the short one's life: the short joins its batch
    # once the long's first token came, and the long has 159 steps to go.
    long_tokens = 160
    long = Streamed(client, LONG, long_tokens)
    long.start()
    assert long.started.wait(60)
    batched, _ = answer(client, SHORT, short_tokens)
    short_done = time.monotonic()
    long.join(60)
    assert long.prompt_tokens > THRESHOLD
    assert len(long.tokens) == long_tokens and long.finished_at > short_done
    assert batched == expected
    # The long row too, roped by each token's position in its prefill and beside the short.
    assert long.tokens == reference(mlx_vlm, LONG, long_tokens)


def test_a_prompt_that_crosses_the_threshold_while_it_decodes_answers_as_mlx_vlm(
    client: openai.OpenAI, mlx_vlm: tuple[Any, Any]
) -> None:
    # mlx-vlm's generate ropes its decode steps by the short factors to position 47, by
    # the long ones from 48, its earlier tokens' keys kept as they were roped.
    max_tokens = 40
    got, prompt_tokens = answer(client, SHORT, max_tokens)
    assert prompt_tokens < THRESHOLD < prompt_tokens + max_tokens
    assert got == reference(mlx_vlm, SHORT, max_tokens)
