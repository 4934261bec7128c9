"""A streaming OpenAI chat client that records what the benchmarks measure."""

from __future__ import annotations

import time

import orjson
from aiohttp import ClientError, ClientSession

from loadtest.stats import RequestRecord


async def stream_chat(session: ClientSession, base_url: str, model: str, messages: list[dict],
                      max_tokens: int, extra: dict,
                      exact: bool = True) -> tuple[RequestRecord, str]:
    """One streamed, greedy chat request: its timings and usage, and the answer's text. A
    request that fails or (when `exact`) returns another length than `max_tokens` carries an
    error."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    record, text = RequestRecord(start=time.perf_counter()), []
    try:
        async with session.post(base_url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}"
                return record, ""
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                if event.get("error"):
                    record.error = "error event"
                for choice in event.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        record.chunk_times.append(time.perf_counter())
                        text.append(content)
                if usage := event.get("usage"):
                    record.output_tokens = usage["completion_tokens"]
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
    except (TimeoutError, OSError, ClientError) as exc:
        record.error = type(exc).__name__
    record.end = time.perf_counter()
    if not record.output_tokens:  # a server without streamed usage: one token per chunk
        record.output_tokens = len(record.chunk_times)
    if record.ok and (not record.chunk_times or exact and record.output_tokens != max_tokens):
        record.error = f"output length {record.output_tokens} != {max_tokens}"
    return record, "".join(text)
