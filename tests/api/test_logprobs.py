"""logprobs / top_logprobs and n > 1 through the official openai client, on a live server.

The tiny random models have flat distributions, so logprobs are far from 0 and
a sampled choice differs from the next one: good for telling values apart.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from omlx.api.server import Server

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 10}


@pytest.fixture(scope="module")
def tokenizer(tiny_models_dir: Path):
    return AutoTokenizer.from_pretrained(str(tiny_models_dir / MODEL))


def chat(client: openai.OpenAI, messages=CHAT, **kw):
    return client.chat.completions.create(messages=messages, **{**GREEDY, **kw})


def token_ids(tokenizer, entries) -> list[int]:
    """The ids of logprob entries, from their bytes (the byte-level vocabulary's
    own spelling of each byte), independently of the server's token strings."""
    spell = bytes_to_unicode()
    return [tokenizer.convert_tokens_to_ids("".join(spell[b] for b in e.bytes)) for e in entries]


def test_greedy_tokens_are_the_top_of_their_sorted_lists(client: openai.OpenAI) -> None:
    choice = chat(client, logprobs=True, top_logprobs=5).choices[0]
    content = choice.logprobs.content
    assert len(content) == 10
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert entry.logprob == max(tops) == tops[0] < 0
        assert entry.token == entry.top_logprobs[0].token
        assert entry.bytes == entry.top_logprobs[0].bytes
    assert (
        b"".join(bytes(e.bytes) for e in content)
        .decode(errors="replace")
        .endswith(choice.message.content[-3:])
    )


@pytest.mark.parametrize("model", [MODEL, "tiny-qwen3"])
def test_logprobs_sum_to_the_teacher_forced_log_likelihood(
    client: openai.OpenAI, tiny_models_dir: Path, model: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models_dir / model))
    content = chat(client, model=model, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    # As the server renders and encodes the conversation.
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    generated = token_ids(tokenizer, content)
    scored = client.completions.create(
        model=model, prompt=prompt_ids + generated, echo=True, logprobs=0, max_tokens=0
    ).choices[0]
    lps = scored.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(prompt_ids) + len(generated)
    assert scored.finish_reason == "length"
    forced = lps[len(prompt_ids) :]
    assert forced == pytest.approx([e.logprob for e in content], abs=2e-3)
    assert sum(forced) == pytest.approx(sum(e.logprob for e in content), abs=1e-2)


def test_streamed_logprobs_equal_the_whole_response(client: openai.OpenAI) -> None:
    whole = chat(client, logprobs=True, top_logprobs=3).choices[0]
    chunks = list(chat(client, logprobs=True, top_logprobs=3, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx(
        [e.logprob for e in whole.logprobs.content], abs=1e-5
    )
    assert all(len(e.top_logprobs) == 3 for e in streamed)
    assert all(c.choices[0].logprobs.refusal is None for c in chunks if c.choices[0].logprobs)


def test_without_logprobs_there_are_none(client: openai.OpenAI) -> None:
    assert chat(client).choices[0].logprobs is None
    only = chat(client, logprobs=True).choices[0].logprobs.content
    assert only and all(e.top_logprobs == [] for e in only)


def test_completions_logprobs_shape(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    choice = client.completions.create(logprobs=3, **kw).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value == max(top.values())  # greedy: the best one
        assert 3 <= len(top) <= 4  # the 3 best plus the chosen token
    assert lp.text_offset[0] == 0
    assert [b - a for a, b in itertools.pairwise(lp.text_offset)] == [
        len(t) for t in lp.tokens[:-1]
    ]
    streamed = [
        (t, v)
        for c in client.completions.create(logprobs=3, stream=True, **kw)
        if c.choices[0].logprobs
        for t, v in zip(
            c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs, strict=True
        )
    ]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, strict=True))


def test_completions_echo_scores_the_prompt_first(client: openai.OpenAI, tokenizer) -> None:
    prompt = "Once upon a time"
    n_prompt = len(tokenizer.encode(prompt))
    kw = {"model": MODEL, "prompt": prompt, "temperature": 0, "logprobs": 1, "echo": True}
    choice = client.completions.create(max_tokens=4, **kw).choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    only = client.completions.create(max_tokens=0, **kw)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    chunks = list(client.completions.create(max_tokens=4, stream=True, **kw))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_batched_requests_some_with_logprobs_give_the_solo_tokens(
    client: openai.OpenAI,
) -> None:
    prompts = [[{"role": "user", "content": f"Story number {i} about boats"}] for i in range(6)]
    solo = [chat(client, p).choices[0].message.content for p in prompts]

    def one(i: int) -> tuple[str, int]:
        choice = chat(client, prompts[i], logprobs=i % 2 == 0 or None).choices[0]
        return choice.message.content, len(choice.logprobs.content) if choice.logprobs else 0

    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(one, range(6)))
    assert [text for text, _ in together] == solo
    assert [n > 0 for _, n in together] == [i % 2 == 0 for i in range(6)]


def test_n_choices_share_one_prompt(client: openai.OpenAI) -> None:
    one = chat(client)
    three = chat(client, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    sampled = {"temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 12}
    first = [c.message.content for c in chat(client, **sampled).choices]
    again = [c.message.content for c in chat(client, **sampled).choices]
    assert first == again
    assert len(set(first)) > 1  # seed + i: the choices differ


def test_streamed_n_interleaves_choices_by_index(client: openai.OpenAI) -> None:
    whole = [c.message.content for c in chat(client, n=2).choices]
    texts = ["", ""]
    finished = set()
    for chunk in chat(client, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert texts == whole and finished == {0, 1}


def test_completions_n_is_prompt_major(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    out = client.completions.create(prompt=["Once upon", "The sea"], n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    texts = [c.text for c in out.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    alone = [client.completions.create(prompt=p, **kw) for p in ("Once upon", "The sea")]
    assert texts[2] == alone[1].choices[0].text
    # Each prompt counted once, however many choices it has.
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("chat/completions", {"n": 9}, "n"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"n": 9}, "n"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_out_of_bounds_is_400_naming_the_field(server: Server, path, extra, field) -> None:
    body = {"model": MODEL, **extra}
    body |= {"messages": CHAT} if path.startswith("chat") else {"prompt": "hi"}
    resp = httpx.post(f"{server.base_url}/v1/{path}", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_values_are_finite_json(client: openai.OpenAI) -> None:
    # A grammar masks most of the vocabulary: masked alternatives are -9999, not -inf.
    choice = chat(
        client,
        logprobs=True,
        top_logprobs=20,
        max_tokens=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    ).choices[0]
    values = [t.logprob for e in choice.logprobs.content for t in e.top_logprobs]
    assert all(math.isfinite(v) and v >= -9999.0 for v in values)
    assert choice.message.content in ("yes", "no")


def test_n_choices_of_a_prompt_longer_than_a_prefill_chunk(client: openai.OpenAI) -> None:
    # The server's prefill chunk is 64 tokens: one choice prefills, the others fork.
    long = [{"role": "user", "content": "The sea is wide and deep. " * 30}]
    one = chat(client, long, logprobs=True)
    three = chat(client, long, n=3, logprobs=True)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens > 128
    for choice in three.choices:
        assert choice.message.content == one.choices[0].message.content
        got = [e.logprob for e in choice.logprobs.content]
        assert got == pytest.approx([e.logprob for e in one.choices[0].logprobs.content], abs=1e-3)
