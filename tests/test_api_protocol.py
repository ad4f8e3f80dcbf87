"""Chat request decoding and validation, sampling ranges, response shapes and the error bodies."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from epdserve.api.errors import (
    ApiError,
    BadRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Timeout,
    Unavailable,
    WorkerFailed,
)
from epdserve.api.protocol import (
    AssistantMessage,
    ChatRequest,
    ImageEmbedsPart,
    ImageUrlPart,
    SystemMessage,
    TextPart,
    UserMessage,
    VideoEmbedsPart,
    VideoUrlPart,
    decode_chat_request,
    to_sampling_params,
)
from epdserve.api.responses import (
    SSE_DONE,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    encode_json,
    sse_error,
    sse_event,
)
from epdserve.media.limits import MediaLimits

LIMITS = MediaLimits()


def body(**fields: Any) -> bytes:
    req: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req.update(fields)
    return json.dumps(req).encode()


def decode(**fields: Any) -> ChatRequest:
    return decode_chat_request(body(**fields), LIMITS)


def rejected(raw: bytes, limits: MediaLimits = LIMITS) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        decode_chat_request(raw, limits)
    assert info.value.status == 400
    return info.value


def bad_sampling(**fields: Any) -> BadRequest:
    req = decode(**fields)
    with pytest.raises(BadRequest) as info:
        to_sampling_params(req, default_max_tokens=64, max_model_len=1024)
    return info.value


def image(url: str = "data:image/png;base64,AAAA") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


# --------------------------------------------------------------------------- decoding


def test_decodes_all_part_kinds_and_tolerates_unknown_fields() -> None:
    handle = {"node": "enc-0", "blocks": [[1, 2], [3]], "nested": {"x": None}}
    req = decode(
        messages=[
            {"role": "system", "content": "be brief", "extra": 1},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look", "annotations": []},
                    {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
                    {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
                    {
                        "type": "image_embeds",
                        "image_embeds": {"image_grid_thw": [1, 4, 6]},
                        "uuid": "abc",
                        "ec_handle": handle,
                    },
                    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4]}, "uuid": "def"},
                ],
            },
            {"role": "assistant", "content": "ok"},
        ],
        stream=True,
        stream_options={"include_usage": True},
        frequency_penalty=0.0,
        tools=None,
        top_logprobs=None,
    )
    assert isinstance(req.messages[0], SystemMessage)
    assert isinstance(req.messages[2], AssistantMessage)
    user = req.messages[1]
    assert isinstance(user, UserMessage) and user.role == "user" and not isinstance(user.content, str)
    text, img, vid, iemb, vemb = user.content
    assert isinstance(text, TextPart) and text.text == "look"
    assert isinstance(img, ImageUrlPart) and img.image_url.detail == "low"
    assert isinstance(vid, VideoUrlPart) and vid.video_url.url == "https://x/v.mp4"
    assert isinstance(iemb, ImageEmbedsPart) and iemb.image_embeds.image_grid_thw == (1, 4, 6)
    assert iemb.ec_handle == handle and iemb.uuid == "abc"
    assert isinstance(vemb, VideoEmbedsPart) and vemb.video_embeds.video_grid_thw == (2, 4, 4)
    assert vemb.ec_handle is None
    assert req.media_parts() == [img, vid, iemb, vemb]
    assert req.include_usage


def test_malformed_json() -> None:
    err = rejected(b'{"model": "m", "messages": [')
    assert "not valid JSON" in err.message
    assert rejected(b"").message.startswith("Request body is not valid JSON")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"temperature": "hot"}, "temperature", "got `str`"),
        ({"max_tokens": 1.5}, "max_tokens", "Expected `int"),
        ({"stream": "yes"}, "stream", "Expected `bool"),
        ({"stop": 3}, "stop", "Expected"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'tool'"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "missing required field `role`"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type", "'audio'"),
        ({"messages": [{"role": "system", "content": [image()]}]}, "messages[0].content[0].type", "'image_url'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url.url",
            "`url`",
        ),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "length >= 1"),
        ({"messages": []}, "messages", "length >= 1"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 0, 2]}, "uuid": "u"}
                        ],
                    }
                ]
            },
            "messages[0].content[0].image_embeds.image_grid_thw[1]",
            ">= 1",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 2]}, "uuid": "u"}],
                    }
                ]
            },
            "messages[0].content[0].video_embeds.video_grid_thw",
            "length 3",
        ),
    ],
)
def test_wrong_types_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    err = rejected(body(**fields))
    assert err.param == param
    assert words in err.message
    assert err.error_type == "invalid_request_error"


def test_missing_model_and_non_object_body() -> None:
    """``model`` is optional, as in vLLM (the served model); ``messages`` is not."""
    req = decode_chat_request(b'{"messages": [{"role": "user", "content": "x"}]}', MediaLimits())
    assert req.model == ""
    assert rejected(b'{"model": "m"}').param == "messages"
    err = rejected(b"[1, 2]")
    assert "Expected `object`" in err.message and err.param is None


def test_only_n_1_is_supported() -> None:
    assert decode(n=1).n == 1
    assert decode(n=None).n is None
    err = rejected(body(n=2))
    assert err.param == "n" and "n=1" in err.message


def test_stream_options_require_stream() -> None:
    err = rejected(body(stream_options={"include_usage": True}))
    assert err.param == "stream_options"
    assert not decode(stream=True).include_usage


def test_image_embeds_grid_must_have_one_temporal_group() -> None:
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [2, 4, 4]}, "uuid": "u"}
    err = rejected(body(messages=[{"role": "user", "content": [part]}]))
    assert err.param == "messages[0].content[0].image_embeds.image_grid_thw"


def test_media_items_per_prompt_limit() -> None:
    limits = MediaLimits(max_images_per_prompt=2, max_videos_per_prompt=0)
    embeds = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "u"}
    two = body(messages=[{"role": "user", "content": [image(), embeds]}])
    assert len(decode_chat_request(two, limits).media_parts()) == 2
    three = body(messages=[{"role": "user", "content": [image()]}, {"role": "user", "content": [image(), embeds]}])
    err = rejected(three, limits)
    assert "At most 2 image(s)" in err.message and err.param == "messages"
    video = body(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://x/v"}}]}])
    assert "At most 0 video(s)" in rejected(video, limits).message


# --------------------------------------------------------------------------- sampling params


def test_sampling_defaults() -> None:
    sp = to_sampling_params(decode(), default_max_tokens=64, max_model_len=1024)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.min_tokens) == (1.0, 1.0, 0, 64, 0)
    assert sp.stop == () and sp.seed is None and not sp.ignore_eos and not sp.logprobs
    # the default never exceeds the context length
    assert to_sampling_params(decode(), default_max_tokens=4096, max_model_len=100).max_tokens == 100


def test_sampling_values_pass_through() -> None:
    req = decode(
        temperature=0.0,
        top_p=0.5,
        top_k=-1,
        max_tokens=10,
        min_tokens=3,
        seed=7,
        stop="###",
        ignore_eos=True,
        logprobs=True,
    )
    sp = to_sampling_params(req, default_max_tokens=64, max_model_len=1024)
    assert sp.greedy and sp.top_p == 0.5 and sp.top_k == 0
    assert (sp.max_tokens, sp.min_tokens, sp.seed, sp.stop) == (10, 3, 7, ("###",))
    assert sp.ignore_eos and sp.logprobs
    both = to_sampling_params(decode(max_tokens=10, max_completion_tokens=20), 64, 1024)
    assert both.max_tokens == 20
    assert to_sampling_params(decode(stop=["a", "b"], top_k=5, temperature=2), 64, 1024).stop == ("a", "b")
    assert to_sampling_params(decode(temperature=1e-9), 64, 1024).greedy


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"max_tokens": 2000}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"seed": 2**70}, "seed"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # logprobs must be true to ask for alternatives
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ],
)
def test_sampling_ranges(fields: dict[str, Any], param: str) -> None:
    err = bad_sampling(**fields)
    assert err.param == param and err.status == 400
    assert param in err.message


def test_logprobs_fields_map_to_sampling_params() -> None:
    def params(**fields: Any) -> tuple[bool, int]:
        sp = to_sampling_params(decode(**fields), 64, 1024)
        return sp.logprobs, sp.top_logprobs

    assert params() == (False, 0)
    assert params(logprobs=None, top_logprobs=None) == (False, 0)  # null is "not given", as OpenAI reads it
    assert params(logprobs=True) == (True, 0)
    assert params(logprobs=True, top_logprobs=0) == (True, 0)
    assert params(logprobs=True, top_logprobs=20) == (True, 20)


@pytest.mark.parametrize(
    "fields", [{"logprobs": 1}, {"logprobs": "yes"}, {"top_logprobs": 2.5}, {"top_logprobs": True}]
)
def test_logprobs_fields_are_typed(fields: dict[str, Any]) -> None:
    err = rejected(body(**fields))
    assert err.param == next(iter(fields))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("cls", "status", "etype"),
    [
        (BadRequest, 400, "invalid_request_error"),
        (NotFound, 404, "invalid_request_error"),
        (PayloadTooLarge, 413, "invalid_request_error"),
        (Overloaded, 429, "rate_limit_error"),
        (WorkerFailed, 502, "server_error"),
        (Unavailable, 503, "server_error"),
        (Timeout, 504, "server_error"),
    ],
)
def test_error_statuses_and_openai_shape(cls: type[ApiError], status: int, etype: str) -> None:
    err = cls("went wrong", param="p")
    assert isinstance(err, ApiError) and err.status == status
    body = json.loads(err.to_json())
    assert list(body) == ["error"]
    assert list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["message"] == "went wrong" and body["error"]["type"] == etype
    assert body["error"]["param"] == "p"


def test_unknown_model_error() -> None:
    err = NotFound.model("nope")
    assert err.status == 404
    assert json.loads(err.to_json()) == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert json.loads(BadRequest("x").to_json())["error"]["code"] is None


# --------------------------------------------------------------------------- responses


def test_completion_matches_openai_client_types() -> None:
    from openai.types.chat import ChatCompletion as OpenAICompletion

    resp = ChatCompletion(
        id="chatcmpl-1",
        created=1,
        model="m",
        choices=[Choice(message=ResponseMessage(content="hello"), finish_reason="stop")],
        usage=Usage.of(5, 2),
    )
    parsed = OpenAICompletion.model_validate_json(encode_json(resp))
    assert parsed.choices[0].message.content == "hello"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage is not None and parsed.usage.total_tokens == 7
    assert json.loads(encode_json(resp))["object"] == "chat.completion"


def sample_logprobs() -> ChoiceLogprobs:
    """Two tokens that split one character (日 = e6 97 a5), each with one alternative."""
    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token="\ufffd",
                logprob=-0.25,
                bytes=[0xE6, 0x97],
                top_logprobs=[TopLogprob(token="\ufffd", logprob=-0.25, bytes=[0xE6, 0x97])],
            ),
            TokenLogprob(token="\ufffd", logprob=-1.5, bytes=[0xA5], top_logprobs=[]),
        ]
    )


def test_logprobs_null_when_not_asked_and_openai_shape_when_asked() -> None:
    from openai.types.chat import ChatCompletion as OpenAICompletion

    plain = ChatCompletion(
        id="c", created=1, model="m", choices=[Choice(message=ResponseMessage(content="日"), finish_reason="stop")]
    )
    choice = json.loads(encode_json(plain))["choices"][0]
    assert list(choice) == ["index", "message", "logprobs", "finish_reason"] and choice["logprobs"] is None

    asked = ChatCompletion(
        id="c",
        created=1,
        model="m",
        choices=[Choice(message=ResponseMessage(content="日"), logprobs=sample_logprobs(), finish_reason="stop")],
    )
    raw = json.loads(encode_json(asked))
    assert raw["choices"][0]["logprobs"]["content"][0] == {
        "token": "\ufffd",
        "logprob": -0.25,
        "bytes": [0xE6, 0x97],
        "top_logprobs": [{"token": "\ufffd", "logprob": -0.25, "bytes": [0xE6, 0x97]}],
    }
    parsed = OpenAICompletion.model_validate(raw).choices[0].logprobs
    assert parsed is not None and parsed.content is not None
    assert bytes(b for t in parsed.content for b in t.bytes or []).decode() == "日"
    assert [t.logprob for t in parsed.content] == [-0.25, -1.5]
    assert parsed.content[0].top_logprobs[0].bytes == [0xE6, 0x97] and parsed.content[1].top_logprobs == []


def test_chunk_logprobs_in_openai_shape() -> None:
    from openai.types.chat import ChatCompletionChunk as OpenAIChunk

    plain = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChunkChoice(delta=Delta(content="a"))])
    assert json.loads(encode_json(plain))["choices"][0]["logprobs"] is None
    asked = ChatCompletionChunk(
        id="c", created=1, model="m", choices=[ChunkChoice(delta=Delta(content="日"), logprobs=sample_logprobs())]
    )
    parsed = OpenAIChunk.model_validate(json.loads(encode_json(asked))).choices[0].logprobs
    assert parsed is not None and parsed.content is not None and len(parsed.content) == 2
    empty = ChunkChoice(delta=Delta(), logprobs=ChoiceLogprobs(content=[]), finish_reason="stop")
    assert json.loads(encode_json(empty))["logprobs"] == {"content": []}


def test_chunks_are_sse_events_in_openai_shape() -> None:
    from openai.types.chat import ChatCompletionChunk as OpenAIChunk

    first = ChatCompletionChunk(
        id="c", created=1, model="m", choices=[ChunkChoice(delta=Delta(role="assistant", content=""))]
    )
    mid = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChunkChoice(delta=Delta(content="Hel"))])
    last = ChatCompletionChunk(
        id="c", created=1, model="m", choices=[ChunkChoice(delta=Delta(), finish_reason="length")]
    )
    usage = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=Usage.of(3, 4))
    for chunk in (first, mid, last, usage):
        event = sse_event(chunk)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        OpenAIChunk.model_validate_json(event[len(b"data: ") : -2])
    mid_json = json.loads(sse_event(mid)[6:])
    assert mid_json["object"] == "chat.completion.chunk"
    assert mid_json["choices"][0]["delta"] == {"content": "Hel"}  # no role after the first chunk
    assert mid_json["choices"][0]["finish_reason"] is None
    assert json.loads(sse_event(last)[6:])["choices"][0]["delta"] == {}
    assert json.loads(sse_event(usage)[6:])["usage"]["total_tokens"] == 7
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert json.loads(sse_error(WorkerFailed("boom"))[6:])["error"]["code"] == "worker_failed"


def test_model_list() -> None:
    from openai.types import Model

    listing = ModelList(data=[ModelCard(id="m", created=1, max_model_len=4096)])
    raw = json.loads(encode_json(listing))
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    assert Model.model_validate(raw["data"][0]).id == "m"


def test_request_roundtrips_through_msgspec() -> None:
    req = decode(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image()]}], seed=3)
    again = msgspec.json.decode(msgspec.json.encode(req), type=ChatRequest)
    assert again == req
