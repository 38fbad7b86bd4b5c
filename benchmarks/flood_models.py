"""Three models in one flood (issue 40's bar), for ``bench_flood.py --realistic --three-models``.

Beside the built-in SmolLM2's clients, two more models get clients of their own
for the whole flood, so the one ceiling is shared all along: the second model (a
random llama of the tests' ``slow-llama`` shape: text prompts of mixed lengths)
and ``bench-vision``, a random llava whose prompts carry an image (its vision
tower and projector run inside the flood). The mid-flood load and unload of the
second model and the release and resume are left out: this flood is about the
memory guard across models, and a 503 for released memory would hide its figures.

Each 400 ``prefill_memory_exceeded`` a request of these two models got is re-sent
alone after the flood: if it then completes, the 400 was false (SmolLM2's 400s
keep the estimate re-check).
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

VISION = "bench-vision"
# The llava's processor resizes every image to this (14-pixel patches: 576 image tokens).
IMAGE_SIZE = 336


def prepare(models: Path) -> None:
    """Build the vision model into the served models folder."""
    from tests.fixtures.tiny_vlms import build_tiny_vlm

    build_tiny_vlm(models / VISION, "llava", seed=0, image_size=IMAGE_SIZE)


def png_data_url(seed: int, size: int = 64) -> str:
    """A random ``size`` x ``size`` RGB picture as a data URL (the processor resizes it)."""
    from PIL import Image

    rng = random.Random(seed)
    pixels = bytes(rng.randrange(256) for _ in range(size * size * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (size, size), pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def clients(args, ask_type, second: str, first_index: int) -> list[list]:
    """``args.extra_clients`` clients for each of the two models, each sending
    ``args.requests_per_client`` requests in turn (``ask_type``: the flood's Ask)."""
    rng = random.Random(args.seed + 1)
    out, index = [], first_index
    for model in (second, VISION):
        for _ in range(args.extra_clients):
            asks = []
            for _ in range(args.requests_per_client):
                length = rng.choice(args.lengths)
                # About ``length`` tokens: the tiny models' tokenizer splits "word " in three.
                text = f"Request {index}. " + "word " * (length // 3)
                if model == VISION:
                    parts = [
                        {"type": "text", "text": text},
                        {"type": "image_url", "image_url": {"url": png_data_url(index)}},
                    ]
                    messages = [{"role": "user", "content": parts}]
                    kind = f"image {length}"
                else:
                    messages = [{"role": "user", "content": text}]
                    kind = f"text {length}"
                asks.append(ask_type(index, model, kind, messages, args.max_tokens))
                index += 1
            out.append(asks)
    return out


async def recheck_alone(run, result, models: tuple[str, ...]) -> None:
    """Re-send each memory 400 of ``models`` alone, after the flood: completed now means
    the 400 was false (it could fit; the flood's other work was in the way)."""
    for outcome in list(result.outcomes):
        if outcome.ask.model not in models or outcome.label != "400 prefill_memory_exceeded":
            continue
        again = await run.ask(outcome.ask)
        false = again.label == "completed"
        result.num_false_400 += false
        verdict = "FALSE 400: it completes alone" if false else f"alone: {again.label}"
        result.rechecks.append(
            f"  #{outcome.ask.index} {outcome.ask.model} {outcome.ask.kind}: {outcome.label} "
            f"in the flood; {verdict}"
        )
