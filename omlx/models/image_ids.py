"""A VLM prompt's image ids, as the model embeds them: pure (no MLX).

A processor writes an image as one placeholder id, a run of image tokens, or (phi3_v)
numbered negative ids; omlx writes the prompt's ids one an embedded row, so the
prefill, the prefix cache, the memory guard and usage count what the model embeds
(models/vlm.py ``VisionEncoder.prompt_ids``).
"""

from __future__ import annotations

from collections.abc import Iterator

from omlx.errors import InvalidRequestError


def with_image_run(ids: list[int], token_id: int, length: int) -> list[int]:
    """``ids`` with the run of image tokens (first to last: one image's) made
    ``length`` long; unchanged where other tokens lie inside the run (the request's
    row check then fails it clearly)."""
    if token_id not in ids:
        return ids
    first = ids.index(token_id)
    last = len(ids) - ids[::-1].index(token_id)
    if any(t != token_id for t in ids[first:last]):
        return ids
    return [*ids[:first], *[token_id] * length, *ids[last:]]


def require_one_id_an_image(ids: list[int], token_id: int, num_images: int, text: str) -> None:
    """An image is one placeholder id: more than the images means the message text
    wrote the image's marker itself (a placeholder with no image to fill it)."""
    found = ids.count(token_id)
    if found != num_images:
        raise InvalidRequestError(
            f"the prompt has {found} image placeholders for {num_images} image(s): a "
            f"message's text writes '{text}' itself; remove it from the text"
        )


def numbered_as_one(ids: list[int], token_id: int, expected: int, text: str) -> list[int]:
    """The processor's ids with image n's rows (-n each) written as ``token_id``; more
    rows than the images' means the message text wrote an image's marker itself (its
    rows would have no image of their own)."""
    out = [token_id if t < 0 else t for t in ids]
    found = out.count(token_id)
    if found != expected:
        raise InvalidRequestError(
            f"the prompt has {found} image rows for its images' {expected}: a message's "
            f"text writes an image marker such as '{text}' itself; remove it from the text"
        )
    return out


def spliced(ids: list[int], token_id: int, rows: Iterator[int]) -> list[int]:
    """``ids`` with each image placeholder written as many times as its image's rows."""
    return [t for token in ids for t in ([token] * next(rows) if token == token_id else [token])]


def collapsed(ids: list[int], token_id: int, rows: Iterator[int]) -> list[int]:
    """``spliced``'s inverse: a placeholder an image, each image's run of rows
    (its own count, in order) taken as one."""
    out: list[int] = []
    i = 0
    while i < len(ids):
        out.append(ids[i])
        i += max(next(rows, 1), 1) if ids[i] == token_id else 1
    return out
