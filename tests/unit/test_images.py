"""Image parts of chat requests (omlx/api/images.py): parsing, bounds, BOS once."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest

from omlx.api.images import (
    MAX_IMAGES_PER_REQUEST,
    ImagePart,
    ImageSink,
    _without_double_bos,
    from_data_url,
)
from omlx.errors import InvalidRequestError


def test_data_urls_decode_and_http_urls_wait_for_the_fetch() -> None:
    part = from_data_url("data:image/png;base64," + base64.b64encode(b"png").decode(), "p")
    assert (part.data, part.url) == (b"png", None)
    assert part.key == ImagePart(b"png", "elsewhere").key  # the bytes are the identity
    remote = from_data_url("https://images.example.com/a.png", "p")
    assert remote.url == "https://images.example.com/a.png" and remote.data == b""
    for bad in ("data:text/plain;base64,aGk=", "data:image/png,raw", "ftp://x/a.png", "https://"):
        with pytest.raises(InvalidRequestError) as info:
            from_data_url(bad, "messages[0].content[1]")
        assert info.value.param == "messages[0].content[1]"


def test_more_images_than_the_bound_name_the_first_one_past_it() -> None:
    sink = ImageSink()
    for i in range(MAX_IMAGES_PER_REQUEST):
        assert sink.add(ImagePart(b"x", f"p[{i}]")) == sink.marker
    with pytest.raises(InvalidRequestError) as info:
        sink.add(ImagePart(b"x", "p[8]"))
    assert info.value.param == "p[8]"
    assert ImageSink().marker != sink.marker  # unique per request: no client can forge it


def _processor(adds_bos: bool) -> SimpleNamespace:
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "[UNK]": 2}, unk_token="[UNK]"))
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    return SimpleNamespace(tokenizer=tokenizer)


def test_a_template_written_bos_is_not_doubled() -> None:
    assert _without_double_bos(_processor(adds_bos=True), "<s>a") == "a"
    assert _without_double_bos(_processor(adds_bos=False), "<s>a") == "<s>a"
    assert _without_double_bos(_processor(adds_bos=True), "a") == "a"
