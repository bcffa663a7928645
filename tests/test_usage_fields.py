"""Usage fields written for a server whose responses carry none (pipeline.runtime.servers.usage):
bodies and server-sent event streams as vllm-mlx sends them. The real server's responses are
checked over HTTP in tests/test_servers_vllm.py."""

from __future__ import annotations

import asyncio
import json

from pipeline.runtime.servers.usage import Reuse, _events_with_usage, _with_usage


def event(data: dict, name: str | None = None) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


def data_of(raw: bytes) -> dict:
    line = next(x for x in raw.split(b"\n") if x.startswith(b"data: "))
    return json.loads(line[6:])


MESSAGE_START = {
    "type": "message_start",
    "message": {"id": "m", "usage": {"input_tokens": 120, "output_tokens": 0}},
}
BLOCK_START = {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}
DELTA = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}
MESSAGE_DELTA = {"type": "message_delta", "usage": {"input_tokens": 120, "output_tokens": 2}}


def run_stream(parts: list, reuse: Reuse, api: str, lookup_before: int | None) -> list[bytes]:
    """The events `_events_with_usage` yields for `parts` (bytes, split anywhere); the lookup
    records 100 cached tokens just before part `lookup_before` is sent (None: never)."""

    async def source():
        for i, part in enumerate(parts):
            if i == lookup_before:
                reuse.cached, reuse.looked_up = 100, True
            yield part

    async def collect():
        return [e async for e in _events_with_usage(source(), reuse, api)]

    return asyncio.run(collect())


def test_a_body_gets_the_reused_tokens_in_its_usage():
    openai = json.dumps({"usage": {"prompt_tokens": 9}}).encode()
    assert json.loads(_with_usage(openai, Reuse(7, True), "openai"))["usage"] == {
        "prompt_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 7},
    }
    anthropic = json.dumps({"usage": {"input_tokens": 9, "output_tokens": 1}}).encode()
    usage = json.loads(_with_usage(anthropic, Reuse(7, True), "anthropic"))["usage"]
    # input_tokens is what was not read from a cache: the client's sum is the prompt's length
    assert (usage["cache_read_input_tokens"], usage["input_tokens"]) == (7, 2)
    assert _with_usage(b"not json", Reuse(7, True), "openai") == b"not json"


def test_message_start_waits_for_the_lookup_and_reports_it():
    stream = event(MESSAGE_START, "message_start") + event(BLOCK_START, "content_block_start")
    stream += event({"type": "ping"}, "ping")
    parts = [stream[:17], stream[17:], event(DELTA), event(MESSAGE_DELTA)]
    out = run_stream(parts, Reuse(), "anthropic", lookup_before=2)
    types = [data_of(e)["type"] for e in out]
    assert types == ["message_start", "content_block_start", "ping", "content_block_delta", "message_delta"]  # fmt: skip
    for usage in (data_of(out[0])["message"]["usage"], data_of(out[-1])["usage"]):
        assert (usage["cache_read_input_tokens"], usage["input_tokens"]) == (100, 20)
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == 120  # the prompt
    assert out[0].startswith(b"event: message_start\ndata: ")


def test_without_a_lookup_the_preamble_goes_with_the_first_generated_event():
    parts = [event(MESSAGE_START), event(DELTA), event(DELTA), event(MESSAGE_DELTA)]
    seen_at: list[int] = []

    async def source():
        for i, part in enumerate(parts):
            seen_at.append(i)
            yield part

    async def first_event_after() -> int:
        async for _ in _events_with_usage(source(), Reuse(), "anthropic"):
            return len(seen_at)  # how many parts the server had sent when the client got one
        return -1

    assert asyncio.run(first_event_after()) == 2  # not held to the end of the stream
    out = run_stream(parts, Reuse(), "anthropic", lookup_before=None)
    assert data_of(out[0])["message"]["usage"]["cache_read_input_tokens"] == 0


def test_openai_chunks_pass_at_once_and_the_usage_chunk_reports_the_reuse():
    chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "Hi"}}]}
    last = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 120}}
    parts = [event(chunk), event(last), b"data: [DONE]\n\n"]
    out = run_stream(parts, Reuse(), "openai", lookup_before=1)
    assert out[0] == event(chunk)  # before the lookup: not held, unchanged
    assert data_of(out[1])["usage"]["prompt_tokens_details"] == {"cached_tokens": 100}
    assert out[2] == b"data: [DONE]\n\n"


def test_a_message_start_sent_before_the_server_counts_the_prompt_gets_its_length():
    """vllm-mlx's streamed message_start says input_tokens 0 (sent before it counts the prompt)
    and its message_delta only output_tokens: the prompt's length as the lookup saw it stands in,
    so the client's sum is the prompt (before: 0 + 361 of a 379-token prompt; outside review)."""
    start = {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 0}}}
    end = {"type": "message_delta", "usage": {"output_tokens": 2}}
    reuse = Reuse(prompt=120)
    out = run_stream([event(start), event(DELTA), event(end)], reuse, "anthropic", 1)
    usage = data_of(out[0])["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (20, 100)
    assert data_of(out[-1])["usage"] == {"output_tokens": 2}


def test_a_server_that_counts_its_reads_in_input_tokens_too_is_set_right():
    """mlx-omni-server reports cache_read_input_tokens itself but input_tokens as the whole prompt
    (prompt + read): its Anthropic usage is corrected from its own count (reuse None)."""
    body = {"usage": {"input_tokens": 382, "output_tokens": 1, "cache_read_input_tokens": 361}}
    usage = json.loads(_with_usage(json.dumps(body).encode(), None, "anthropic"))["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (21, 361)
    cold = {"usage": {"input_tokens": 30, "output_tokens": 1, "cache_read_input_tokens": None}}
    usage = json.loads(_with_usage(json.dumps(cold).encode(), None, "anthropic"))["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (30, 0)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 0}}}
    end = {"type": "message_delta", "usage": {"input_tokens": 379, "cache_read_input_tokens": 363}}
    parts = [event(start), event(DELTA), event(end)]
    out = asyncio.run(_collect(_events_with_usage(_source(parts), None, "anthropic")))
    assert data_of(out[0])["message"]["usage"]["input_tokens"] == 0  # its placeholder, at once
    assert data_of(out[-1])["usage"]["input_tokens"] == 16


async def _source(parts):
    for part in parts:
        yield part


async def _collect(events):
    return [e async for e in events]
