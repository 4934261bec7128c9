"""Concurrent streamed requests are batched together. With --deterministic each gets exactly what
it would get alone; in the default mode (F16 KV, where llama.cpp's kernels round differently for
different batch shapes) each completes, and the engine is left empty."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.conftest import openai_client

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "List three prime numbers.", "Explain what a radix tree is in one sentence.",
    "Translate 'good morning' into Spanish.", "What is 12 times 7?",
    "Name a famous physicist.", "Describe a cat in five words.",
]


def _stream(client, model_name, question: str, max_tokens: int) -> str:
    chunks = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_eight_concurrent_streams_equal_their_solo_runs(deterministic_gateway, model_name):
    client = openai_client(deterministic_gateway)
    # Different lengths, so sequences join and leave the batch at different steps (a few
    # tokens apart: 720 tokens in all, so a busy machine finishes too).
    jobs = [(q, 16 + 4 * i) for i, q in enumerate(QUESTIONS)]
    alone = [_stream(client, model_name, q, n) for q, n in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for _ in range(2):
            together = list(pool.map(lambda job: _stream(client, model_name, *job), jobs))
            assert together == alone
    deterministic_gateway.settled()


def test_more_requests_than_sequences_queue_and_complete(deterministic_gateway, model_name):
    client = openai_client(deterministic_gateway)
    jobs = [(q, 16) for q in QUESTIONS * 2]  # 16 requests for 8 sequences
    alone = {q: _stream(client, model_name, q, 16) for q in QUESTIONS}
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: _stream(client, model_name, *job), jobs))
    assert together == [alone[q] for q, _ in jobs]
    deterministic_gateway.settled()


def test_default_mode_serves_more_requests_than_sequences(client, model_name, gateway):
    jobs = [(q, 16 + i) for i, q in enumerate(QUESTIONS * 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: _stream(client, model_name, *job), jobs))
    assert all(together)
    metrics = gateway.settled()
    assert metrics["prefixgate_kv_cells_used"] == 0
