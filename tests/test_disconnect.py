"""Clients that go away free their sequence; the engine keeps nothing and serves on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import aiohttp
import pytest


def _body(model: str, question: str, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": 1500, "temperature": 0, "stream": stream, "ignore_eos": True}


async def _abandon(session: aiohttp.ClientSession, url: str, body: dict, read_chunks: int):
    async with session.post(url, json=body) as response:
        assert response.status == 200
        for _ in range(read_chunks):
            await response.content.readline()
        # Leaving the block mid-stream closes the connection.


async def _abandon_many(base_url: str, model: str) -> None:
    url = base_url + "/v1/chat/completions"
    # Half wait for a sequence before their first byte: on a busy machine, for minutes.
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Twice as many as there are sequences: half are dropped while still waiting.
        await asyncio.gather(*(
            _abandon(session, url, _body(model, f"Tell story number {i}.", True), i % 6)
            for i in range(16)))
    # Non-streaming clients that give up before the answer.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
        for i in range(4):
            with contextlib.suppress(TimeoutError):
                await session.post(url, json=_body(model, f"Essay {i}.", False))


def abandon_many(base_url: str, model: str) -> None:
    asyncio.run(_abandon_many(base_url, model))


def test_abandoned_requests_free_their_sequences(gateway, client, model_name):
    before = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=12, temperature=0).choices[0].message.content
    for _ in range(2):
        abandon_many(gateway.base_url, model_name)
        metrics = gateway.settled(timeout=60)
        assert metrics["prefixgate_num_requests_running"] == 0
    after = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=12, temperature=0).choices[0].message.content
    assert after == before


def test_stream_events_are_json_until_done(gateway, model_name):
    async def read_all() -> list[bytes]:
        async with aiohttp.ClientSession() as session, session.post(
                gateway.base_url + "/v1/chat/completions",
                json={**_body(model_name, "Hi", True), "max_tokens": 5}) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            return [line for line in (await response.read()).split(b"\n\n") if line]
    events = asyncio.run(read_all())
    assert events[-1] == b"data: [DONE]"
    for event in events[:-1]:
        assert event.startswith(b"data: ") and "choices" in json.loads(event[6:])


async def _cut_at(session: aiohttp.ClientSession, url: str, body: dict, seconds: float) -> int:
    """Reads a stream for `seconds` (or until it ends), then drops the connection."""
    async with session.post(url, json=body) as response:
        if response.status == 200:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    while await response.content.readline():
                        pass
        return response.status


@pytest.mark.timeout(1200)  # ~40 s here; a busy machine's cores make each cut stream slower
def test_a_storm_of_200_cut_streams_leaves_nothing_held(gateway, client, model_name):
    question = [{"role": "user", "content": "Describe a harbour at dawn."}]
    before = client.chat.completions.create(model=model_name, messages=question, max_tokens=16,
                                            temperature=0).choices[0].message.content
    rng = random.Random(7)

    async def storm() -> list[int]:
        url = gateway.base_url + "/v1/chat/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(
                _cut_at(session, url, _body(model_name, f"Story {i}, part {rng.randint(1, 99)}.",
                                            True), rng.uniform(0.0, 4.0))
                for i in range(200)))

    statuses = asyncio.run(storm())
    assert set(statuses) <= {200, 429} and statuses.count(200) > 100
    metrics = gateway.settled(timeout=60)  # includes the consistency check
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0
    assert metrics["prefixgate_kv_cells_used"] == 0
    after = client.chat.completions.create(model=model_name, messages=question, max_tokens=16,
                                           temperature=0).choices[0].message.content
    assert after == before
