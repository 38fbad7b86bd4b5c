"""Images in chat requests: read the API's image parts into checked images, and
run the model's processor over the prompt text and its images.

Pure (no MLX): runs on the event loop (decoding base64) and on the render pool
(the processor). Every bad image is a 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from omlx.errors import InvalidRequestError
from omlx.memory.vision import pixel_shapes

# Bounds per image and per request: a decoded image costs ~4 bytes per pixel on
# the processor and the vision tower's transient grows with the image tokens.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES_PER_REQUEST = 8


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image as the client sent it, with where it came from (for errors)."""

    data: bytes
    where: str
    # An http(s) image to fetch before rendering (image_fetch.py); data is empty until then.
    url: str | None = None

    @property
    def key(self) -> str:
        """The image's identity for the prefix cache: a hash of its bytes."""
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A prompt's images as the vision tower takes them."""

    # A numpy array (images, channels, height, width); or a list of arrays a prompt,
    # each at its own size (MiniCPM-V's slices, MiniCPM-o's images: memory.vision.pixel_shapes).
    pixel_values: Any
    keys: tuple[str, ...]
    num_image_tokens: int
    # What else the family's vision tower takes (e.g. pixtral's image_sizes).
    extras: dict[str, Any] = field(default_factory=dict)


class ImageSink:
    """A request's images gathered from its messages, in order. Each stands in the
    message text as a marker no client can forge (unique per request); rendering
    puts the model's image token there."""

    def __init__(self, url_allowlist: Sequence[str] = ()) -> None:
        self.marker = f"<omlx-image-{uuid.uuid4().hex}>"
        self.parts: list[ImagePart] = []
        # Host globs whose http(s) image URLs are fetched (models.image_url_allowlist).
        self.url_allowlist = tuple(url_allowlist)

    def add(self, part: ImagePart) -> str:
        self.parts.append(part)
        check_count(self.parts)
        return self.marker


def from_data_url(url: str, where: str) -> ImagePart:
    """An image part's URL: a base64 data URL, or an http(s) URL fetched later (if
    models.image_url_allowlist lets its host)."""
    if url.startswith(("http://", "https://")):
        if not urlsplit(url).hostname:
            raise InvalidRequestError(f"{where}: the image URL has no host", param=where)
        return ImagePart(b"", where, url)
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise InvalidRequestError(
            f"{where}: expected a data URL like data:image/png;base64,<data> (or an "
            "http(s) URL from a host in models.image_url_allowlist)",
            param=where,
        )
    return from_base64(payload, where)


def from_base64(payload: str, where: str) -> ImagePart:
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise _too_large(where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the image is not valid base64", param=where) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise _too_large(where)
    return ImagePart(data, where)


def _too_large(where: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{where}: the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB; "
        "send a smaller image",
        param=where,
    )


def check_count(parts: list[ImagePart]) -> None:
    if len(parts) > MAX_IMAGES_PER_REQUEST:
        raise InvalidRequestError(
            f"{parts[MAX_IMAGES_PER_REQUEST].where}: a request may carry at most "
            f"{MAX_IMAGES_PER_REQUEST} images (this one has {len(parts)})",
            param=parts[MAX_IMAGES_PER_REQUEST].where,
        )


def open_image(part: ImagePart) -> Any:
    """The decoded RGB image (PIL); 400 when it does not decode or has too many pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(part.data)) as img:
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"{part.where}: the image is {width}x{height} pixels; the limit is "
                    f"{MAX_IMAGE_PIXELS} pixels, send a smaller image",
                    param=part.where,
                )
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise InvalidRequestError(
            f"{part.where}: the image could not be decoded; send a PNG, JPEG, GIF or WebP",
            param=part.where,
        ) from None


def process(
    processor: Any,
    text: str,
    parts: list[ImagePart],
    image_token_id: int,
    prompt_ids: Callable[[list[int], Sequence[int], dict[str, Any]], list[int]],
) -> tuple[list[int], PromptImages]:
    """Token ids of ``text`` with each image's tokens expanded, and the pixels
    (runs on the render pool). ``prompt_ids``: the processor's ids, the pixels'
    shape and its other outputs -> the ids omlx prefills, one a row of the model's embedding
    (VisionEncoder.prompt_ids)."""
    images = [open_image(p) for p in parts]
    text = _without_double_bos(processor, text)
    try:
        out = processor(text=text, images=images, return_tensors="np")
    except ValueError as exc:
        # mlx-vlm's processors check the prompt's image markers against its images
        # (MiniCPM-V 4.7's: a marker the message text writes itself has no image).
        raise InvalidRequestError(
            f"the model's processor refused the prompt's {len(parts)} image(s): {exc} (a "
            "message whose text writes the model's image marker itself leaves a marker "
            "without an image: remove it from the text)",
            param="messages",
        ) from exc
    ids = [int(t) for t in out["input_ids"][0]]
    if ids and ids[-1] == image_token_id:
        # The prompt's last token goes through the decode batch by id, not embedded.
        raise InvalidRequestError(
            f"{parts[-1].where}: the prompt ends with an image; put text after it",
            param=parts[-1].where,
        )
    count = sum(1 for t in ids if t == image_token_id)
    extras = {k: _on_host(v) for k, v in out.items() if k not in _TEXT_FIELDS}
    pixels = _on_host(out["pixel_values"])
    # The first array's shape: the families whose rows follow it have one array.
    ids = prompt_ids(ids, pixel_shapes(pixels)[0], extras)
    return ids, PromptImages(pixels, tuple(p.key for p in parts), count, extras)


_TEXT_FIELDS = ("input_ids", "attention_mask", "pixel_values")


def _on_host(value: Any) -> Any:
    """An MLX array as numpy: some processors return MLX arrays whatever
    ``return_tensors`` asks (InternVL's), made on this render thread's stream, which
    the engine's MLX thread cannot evaluate."""
    if type(value).__module__.startswith("mlx"):
        import numpy as np

        return np.asarray(value)
    return value


def _without_double_bos(processor: Any, text: str) -> str:
    """The processor's tokenizer adds its BOS (processors take no add_special_tokens):
    a chat template that wrote one already loses its copy, so there is one BOS."""
    tokenizer = getattr(processor, "tokenizer", None)
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not text.startswith(bos) or tokenizer is None:
        return text
    adds_bos = tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    return text[len(bos) :] if adds_bos else text
