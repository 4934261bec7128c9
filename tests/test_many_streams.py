"""128 concurrent streams on one system prompt out of one pool of cells: every stream completes,
and the prompt's cells are shared, not copied 128 times."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession

from loadtest.client import stream_chat
from loadtest.gateway_process import GatewayProcess

SYSTEM = "You are the help desk of the Lakeside public library. " * 36  # ~400 tokens
STREAMS = 128


async def _all_at_once(server: GatewayProcess) -> list:
    async with ClientSession() as session:
        return await asyncio.gather(*(stream_chat(
            session, server.base_url, server.model_name,
            [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Is book number {i} on the shelf?"}],
            8, {"ignore_eos": True}) for i in range(STREAMS)))


def test_128_streams_share_one_prompt(model_path):
    # 6,144 cells: the prompt once and every stream's own tokens, far from 128 private copies.
    server = GatewayProcess(model_path, "--parallel", str(STREAMS), "--ctx-size", "6144")
    try:
        results = asyncio.run(_all_at_once(server))
        assert [r.error for r, _ in results] == [None] * STREAMS
        assert sum(r.cached_tokens > 350 for r, _ in results) >= STREAMS - 1
        metrics = server.settled()
        assert metrics["prefixgate_prefix_shared_tokens_total"] > 350 * (STREAMS - 2)
        assert metrics["prefixgate_num_preemptions_total"] == 0
        assert metrics["prefixgate_kv_cells_used"] == 0
    finally:
        server.stop()
