"""Fixed prompts for the peer benchmark: the same bytes go to every server.

Decode prompts ask for long, open-ended text so a server that cannot ignore EOS
still decodes the full ``max_tokens`` with greedy sampling; the client reports
the tokens each server really produced.
"""

from __future__ import annotations

DECODE_TOPICS = [
    "the history of the printing press",
    "how a steam engine works",
    "the life cycle of a star",
    "the rules of chess",
    "how bread is baked",
    "the water cycle",
    "how a bicycle is built",
    "the migration of birds",
    "the invention of the telephone",
    "how volcanoes form",
    "the history of the Roman roads",
    "how a lighthouse works",
    "the growth of a tree",
    "how paper is made",
    "the tides of the ocean",
    "how a clock keeps time",
]

LONG_QUESTION = "Which rooms were warmest, and what pattern do you see in the readings?"
NEW_TURN = "Thanks. Now list the three coldest readings."

ROOMS = ["kitchen", "library", "attic", "cellar", "hall", "study", "garage", "porch"]


def decode_messages(i: int, nonce: str) -> list[dict[str, str]]:
    """A long-answer request for stream ``i``. ``nonce`` opens the user turn, so no
    request reuses another's prompt (from this row or an earlier one) beyond the
    chat template's fixed opening: the rows measure batching, not the prefix cache."""
    topic = DECODE_TOPICS[i % len(DECODE_TOPICS)]
    return [
        {
            "role": "user",
            "content": f"Request {nonce}-{i}: write a very long, detailed essay about "
            f"{topic}, with many sections and examples.",
        }
    ]


def sensor_log(num_lines: int) -> str:
    """A deterministic, natural-looking log; ~17 tokens per line with SmolLM2's tokenizer."""
    lines = []
    for n in range(num_lines):
        room = ROOMS[(n * 5) % len(ROOMS)]
        temp = 14 + (n * 7) % 13
        lines.append(f"Reading {n + 1}: the sensor in the {room} measured {temp} degrees.")
    return "\n".join(lines)


def long_messages(session: str, num_lines: int = 80) -> list[dict[str, str]]:
    """~1,400 prompt tokens (80 lines) whose first tokens name ``session``, so each
    session is cold on any prefix cache."""
    return [
        {"role": "system", "content": f"Session {session}. You answer from the log below."},
        {"role": "user", "content": f"{sensor_log(num_lines)}\n\n{LONG_QUESTION}"},
    ]


def next_turn(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    """The conversation as a chat client sends it back: its answer plus one short turn."""
    turn = [{"role": "assistant", "content": answer}, {"role": "user", "content": NEW_TURN}]
    return [*messages, *turn]
