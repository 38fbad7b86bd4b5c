"""Ollama request fields -> our pipeline, and engine events -> Ollama objects."""

from __future__ import annotations

import math

import pytest

from omlx.api.images import ImageSink
from omlx.api.ollama_format import (
    OllamaReply,
    Timings,
    chat_messages,
    keep_alive_s,
    omlx_name,
    sampling_request,
)
from omlx.api.ollama_schemas import Message, Options
from omlx.api.output_budget import output_budget
from omlx.api.output_parser import OutputParser
from omlx.engine.stream import StreamEvent
from omlx.errors import ContextLengthExceededError, InvalidRequestError


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (300, 300.0),
        (-1, math.inf),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("0", 0.0),
        ("-1", math.inf),
        ("-1m", math.inf),
        ("90", 90.0),
        (1e300, math.inf),
        ("inf", math.inf),
    ],
)
def test_keep_alive_durations(value: float | str | None, seconds: float | None) -> None:
    assert keep_alive_s(value) == seconds


@pytest.mark.parametrize("value", ["forever", "5 minutes", "m", "", "5d", "nan", math.nan])
def test_keep_alive_that_is_no_duration_is_a_400_naming_it(value: str | float) -> None:
    with pytest.raises(InvalidRequestError) as info:
        keep_alive_s(value)
    assert info.value.param == "keep_alive"


def test_latest_is_the_only_tag() -> None:
    assert omlx_name("smollm2:latest") == "smollm2"
    assert omlx_name("org/model") == "org/model"
    assert omlx_name("smollm2:7b") == "smollm2:7b"  # not found later, by that name


def test_tool_answers_name_the_call_they_answer() -> None:
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = chat_messages(
        [
            Message(role="user", content="Weather?"),
            Message.model_validate({"role": "assistant", "tool_calls": [call]}),
            Message(role="tool", content="21 C", tool_name="get_weather"),
        ],
        ImageSink(),
    )
    (openai_call,) = messages[1]["tool_calls"]
    assert openai_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[2]["tool_call_id"] == openai_call["id"]
    assert messages[2]["name"] == "get_weather"


def test_images_stand_before_the_text_and_bad_ones_are_refused_naming_the_image() -> None:
    sink = ImageSink()
    (message,) = chat_messages([Message(role="user", content="see", images=["aGk="])], sink)
    assert message["content"] == f"{sink.marker}\nsee"
    assert [(p.data, p.where) for p in sink.parts] == [(b"hi", "messages[0].images[0]")]
    with pytest.raises(InvalidRequestError) as info:
        chat_messages([Message(role="user", content="see", images=["aGk=", "*"])], ImageSink())
    assert info.value.param == "messages[0].images[1]"


def test_num_predict_and_num_ctx() -> None:
    assert sampling_request(Options(num_predict=5), 10, 100).max_tokens == 5
    # More than the window leaves: the pipeline's budget caps it, as Ollama stops at
    # the context's end (num_ctx's end when it is smaller).
    budget = output_budget("m", 100, 10, sampling_request(Options(num_predict=500), 10, 100), 64)
    assert (budget.max_tokens, budget.requested) == (90, 500)
    smaller = sampling_request(Options(num_predict=500, num_ctx=50), 10, 100)
    assert output_budget("m", 100, 10, smaller, 64).max_tokens == 40
    assert sampling_request(Options(num_predict=-1), 10, 100).max_tokens == 90
    assert sampling_request(Options(), 10, 100).max_tokens is None  # the server's default
    assert sampling_request(Options(num_ctx=50), 10, 100).max_tokens == 40
    assert sampling_request(Options(num_ctx=0), 10, 100).max_tokens is None  # the window
    with pytest.raises(InvalidRequestError) as info:
        sampling_request(Options(num_ctx=101), 10, 100)
    assert info.value.param == "options.num_ctx"
    with pytest.raises(ContextLengthExceededError):
        sampling_request(Options(num_ctx=10), 10, 100)


def test_options_map_to_sampling() -> None:
    opts = Options(temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, repeat_penalty=1.1, seed=3)
    wanted = sampling_request(opts.model_copy(update={"stop": ["\n"]}), 10, 100)
    assert (wanted.temperature, wanted.top_p, wanted.top_k, wanted.min_p) == (0.5, 0.9, 40, 0.1)
    assert wanted.repetition_penalty == 1.1 and wanted.seed == 3 and wanted.stop == ("\n",)


def test_reply_streams_deltas_then_done_and_the_body_has_everything() -> None:
    reply = OllamaReply("m:latest", OutputParser(), Timings(), chat=True)
    first = reply.add(
        StreamEvent(text="<think>hm</think>Hel", num_prompt_tokens=7, num_output_tokens=3)
    )
    last = reply.add(StreamEvent(text="lo", num_output_tokens=4, finish_reason="length"))
    assert [o["done"] for o in first + last] == [False, False, True]
    assert first[0]["message"] == {"role": "assistant", "content": "Hel", "thinking": "hm"}
    done = last[-1]
    assert done["done_reason"] == "length" and done["message"]["content"] == ""
    assert (done["prompt_eval_count"], done["eval_count"]) == (7, 4)
    body = reply.body()
    assert body["message"] == {"role": "assistant", "content": "Hello", "thinking": "hm"}
    assert body["total_duration"] >= body["eval_duration"] >= 0


def test_generate_reply_uses_response() -> None:
    reply = OllamaReply("m:latest", OutputParser(think=None), Timings(), chat=False)
    reply.add(StreamEvent(text="Hi", num_output_tokens=1, finish_reason="stop"))
    body = reply.body()
    assert body["response"] == "Hi" and "message" not in body and body["done_reason"] == "stop"
