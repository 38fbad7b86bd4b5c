"""Incremental detokenization on a real byte-level BPE tokenizer, and stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from omlx.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tests.fixtures.tiny_models import train_tokenizer

REPLACEMENT = "\ufffd"

MULTIBYTE_TEXTS = [
    "café crème brûlée",
    "日本語のテキスト",
    "emoji 🙂🚀 done",
    "mixed: naïve 中文 → ∑ 🙂\nnew line",
    "🚀🚀🚀",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] = ()) -> list[str]:
    """Every chunk the detokenizer emits for ``ids``, the flush last."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_tokenizer_splits_multibyte_characters_across_tokens(tokenizer):
    # The premise of the tests below: single tokens hold partial UTF-8 characters.
    for text in ("é", "日本語", "🙂🚀"):
        ids = tokenizer.encode(text).ids
        assert len(ids) > len(text)
        assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_chunks_join_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids

    chunks = stream(tokenizer, ids)

    assert "".join(chunks) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_no_chunk_holds_a_replacement_character(tokenizer, text):
    ids = tokenizer.encode(text).ids

    chunks = stream(tokenizer, ids)

    assert [c for c in chunks if REPLACEMENT in c] == []
    assert sum(1 for c in chunks if c) > 1  # really incremental, not one chunk at the end


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_every_truncation_joins_to_its_decode(tokenizer, text):
    # Cut mid-character too: whatever is left incomplete comes out of flush().
    ids = tokenizer.encode(text).ids
    for k in range(1, len(ids) + 1):
        assert "".join(stream(tokenizer, ids[:k])) == tokenizer.decode(ids[:k])


def test_random_texts_stream_exactly(tokenizer):
    rng = random.Random(1234)
    alphabet = list("abc xyz.,\n") + list("éüλй中文日本語") + ["🙂", "🚀", "✨", "→"]
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text).ids
        chunks = stream(tokenizer, ids)
        assert "".join(chunks) == text
        assert not any(REPLACEMENT in c for c in chunks), (text, chunks)


@pytest.mark.parametrize("prompt_text", ["Prompt with words", "日本語", "end 🙂🚀"])
def test_prompt_context_is_not_emitted(tokenizer, prompt_text):
    # The context window (last few prompt tokens) may start mid-character.
    prompt = tokenizer.encode(prompt_text).ids
    generated = tokenizer.encode(" and then 🙂 more").ids

    chunks = stream(tokenizer, generated, prompt_ids=prompt)

    assert "".join(chunks) == " and then 🙂 more"
    assert not any(REPLACEMENT in c for c in chunks)


def test_an_image_placeholder_in_the_prompt_context_is_not_decoded(tokenizer):
    # fastvlm's and llava_bunny's prompts hold mlx-vlm's -200 a row of an image; a
    # tokenizer raises on it (OverflowError), so the context leaves it out.
    prompt = [*tokenizer.encode("look").ids, -200, -200]
    generated = tokenizer.encode(" and then 🙂 more").ids

    assert "".join(stream(tokenizer, generated, prompt_ids=prompt)) == " and then 🙂 more"


def test_first_generated_token_keeps_its_leading_space_byte_level(tokenizer):
    prompt = tokenizer.encode("Hello").ids
    generated = tokenizer.encode(" world").ids

    first = IncrementalDetokenizer(tokenizer, prompt).add(generated[0])

    assert first.startswith(" ")
    assert first.strip()


def test_first_generated_token_keeps_its_leading_space_sentencepiece():
    # Metaspace decoders drop the space of the first token of a decode; the
    # prompt context is what keeps it.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert tok.decode([2]) == "world"

    assert stream(tok, [2, 3], prompt_ids=[1]) == [" world", "!", ""]
    assert stream(tok, [2, 3], prompt_ids=[]) == ["world", "!", ""]


def test_special_tokens_produce_no_text(tokenizer):
    end = tokenizer.token_to_id("<|im_end|>")
    ids = [*tokenizer.encode("hi 🙂").ids, end]

    assert "".join(stream(tokenizer, ids)) == "hi 🙂"


# ---- StopStringMatcher -----------------------------------------------------------


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], bool]:
    out = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit is not None:
            return out, True
    return [*out, matcher.flush()], False


def test_stop_split_across_chunks():
    matcher = StopStringMatcher(["llo"])

    assert matcher.feed("Hel") == ("He", None)
    assert matcher.feed("lo") == ("", "llo")


def test_text_before_stop_is_emitted_and_after_is_dropped():
    matcher = StopStringMatcher(["STOP"])

    assert matcher.feed("one two STOP three") == ("one two ", "STOP")


def test_the_stop_string_that_matched_first_is_named():
    matcher = StopStringMatcher(["three", "two", "tw"])

    # "two" and "tw" start at the same place: the longer one is the match.
    assert matcher.feed("one two three") == ("one ", "two")


def test_partial_prefix_is_held_then_released_when_ruled_out():
    matcher = StopStringMatcher(["</end>"])

    assert matcher.feed("x </e") == ("x ", None)
    assert matcher.feed("n") == ("", None)
    assert matcher.feed("x y") == ("</enx y", None)
    assert matcher.flush() == ""


def test_held_text_counts_toward_a_later_stop():
    matcher = StopStringMatcher(["</end>"])

    out, hit = feed_all(matcher, ["a <", "/e", "nd", "> tail"])

    assert hit
    assert "".join(out) == "a "


@pytest.mark.parametrize("stops", [["world", "lo"], ["lo", "world"]])
def test_earliest_stop_wins(stops):
    matcher = StopStringMatcher(stops)

    assert matcher.feed("hello world") == ("hel", "lo")


def test_flush_returns_held_text_once():
    matcher = StopStringMatcher(["<stop>"])

    assert matcher.feed("ab<st") == ("ab", None)
    assert matcher.flush() == "<st"
    assert matcher.flush() == ""
    assert matcher.feed("x") == ("x", None)


@pytest.mark.parametrize("stops", [[], [""]])
def test_no_stops_passes_text_through(stops):
    matcher = StopStringMatcher(stops)

    assert matcher.feed("anything <| at all") == ("anything <| at all", None)
    assert matcher.flush() == ""


def first_stop_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Reference: grow the text one character at a time; cut at the first stop seen."""
    for end in range(1, len(text) + 1):
        starts = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if starts:
            return text[: min(starts)], True
    return text, False


def test_character_stream_matches_reference():
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        out, hit = feed_all(StopStringMatcher(stops), list(text))
        assert ("".join(out), hit) == first_stop_cut(text, stops), (text, stops)


def test_a_long_stop_split_over_many_chunks_is_found_among_many_stops():
    stop = "<|" + "x" * 250 + "|>"
    stops = [stop] + [f"<|x{i}" for i in range(15)]
    matcher = StopStringMatcher(stops)
    text = "before " + stop + " after"
    chunks = [text[i : i + 3] for i in range(0, len(text), 3)]

    out, hit = feed_all(matcher, chunks)

    assert hit
    assert "".join(out) == "before "


def test_random_chunks_cut_where_one_whole_feed_does():
    # Each feed searches only where a new match can end; chunking must not change
    # the cut. (The stops end in a character found nowhere else in any stop, so
    # none can end inside another: first to end is also first to start.)
    rng = random.Random(11)
    for _ in range(300):
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(2, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) + "c", "dd"]
        whole, stop = StopStringMatcher(stops).feed(text)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(5, len(text) - 1)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

        out, hit = feed_all(StopStringMatcher(stops), chunks)

        assert ("".join(out), hit) == ((whole, True) if stop else (text, False)), (text, stops)
