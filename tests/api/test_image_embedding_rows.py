"""An image prompt whose embedding has more rows than the prompt has tokens fails
alone, with a clear error, and the server keeps serving.

omlx prefills one embedding row per prompt token. mlx-vlm's llava_next splices more
image features (every tile's patches, a newline block a tile) than its processor
writes image tokens; omlx serves it by repeating the image token once a row
(vlm_families.Family.image_blocks). Here a tiny llava_next is served without that
rule (monkeypatched into FAMILIES): it stands in for a future family, or a processor
version, whose rows omlx does not know, which the request-time check in
engine/image_prefill.py must catch instead of answering from cut-off embeddings."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from omlx.models import vlm_families
from tests.api.test_vision import ask, chat, error_of, png
from tests.fixtures import tiny_vlms
from tests.fixtures.servers import live_server


def test_an_image_embedding_longer_than_the_prompt_fails_alone_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(vlm_families.FAMILIES, "llava_next", vlm_families.Family(max_images=1))
    root = tmp_path / "models"
    tiny_vlms.build_tiny_vlm(root / "tiny-llava-next", "llava_next", seed=0)
    with live_server(tmp_path / "base", root, scheduler={"max_concurrent_requests": 4}) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        text_only = [{"role": "user", "content": "hello there"}]
        with ThreadPoolExecutor(2) as pool:
            # A text request beside it: it answers whatever the image request does.
            beside = pool.submit(chat, client, "tiny-llava-next", text_only, 16)
            with pytest.raises(openai.APIStatusError) as info:
                chat(client, "tiny-llava-next", ask(png(1)))
            assert beside.result().choices[0].finish_reason in ("stop", "length")
        assert info.value.status_code == 501
        error = error_of(info.value)
        assert error["code"] == "image_embedding_mismatch"
        message = error["message"]
        assert "image embedding does not match its prompt" in message
        assert "'llava_next'" in message
        rows, tokens = _counts(message)
        assert rows > tokens
        # The model and the server keep serving: text, and the next image request's
        # same clear error (not a hang, not a batch gone one-at-a-time).
        assert chat(client, "tiny-llava-next", text_only).choices[0].message.content
        with pytest.raises(openai.APIStatusError) as again:
            chat(client, "tiny-llava-next", ask(png(2)))
        assert again.value.status_code == 501


def _counts(message: str) -> tuple[int, int]:
    """(rows, tokens) from '... embedded R rows for the prompt's T tokens ...'."""
    words = message.split()
    rows = int(words[words.index("rows") - 1])
    tokens = int(words[words.index("tokens,") - 1])
    return rows, tokens
