"""Speculative decoding (engine/speculation.py): tokens drafted from the request's own text and
verified in the step's batch. The output is the one without drafts: greedy and seeded sampling
alike, in both engine modes, with grammars, through the gateway as in the engine; and rejected
drafts, cancellations and preemption leave no cell or block behind."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections import Counter

import openai
import pytest

from engine.config import CacheConfig, EngineConfig
from engine.messages import GenerationRequest, SamplerSettings
from engine.scheduler import PRIOR, StepCost
from engine.speculation import (
    MAX_DRAFTING_STREAMS,
    Acceptance,
    Drafter,
    PredictedOutput,
    PromptLookup,
    SuffixIndex,
    draft_row_worth,
)
from loadtest.gateway_process import GatewayProcess
from tests.conftest import DEFAULT_ARGS, openai_client, serve
from tests.local_engine import LocalEngine

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''
RECORD = {"id": 4182, "name": "Ada Lovelace", "email": "ada@example.org",
          "roles": ["admin", "editor"], "address": {"city": "London", "zip": "NW1 6XE"}}
# Workloads whose answers repeat their prompts: an edit of a file, and a JSON record copied.
CHATS = {
    "edit": [{"role": "user", "content": "Repeat this Python code exactly, but rename "
                                         f"fibonacci to fib:\n\n{CODE}"}],
    "json": [{"role": "user", "content": "Copy this JSON record exactly, as JSON:\n"
                                         + json.dumps(RECORD, indent=2)}],
}


# ----- drafts and their length ---------------------------------------------------------------

def test_a_draft_is_what_followed_the_latest_occurrence():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 0, 1, 2, 3]
    assert PromptLookup().draft(tokens, 2) == (3, [7, 8])  # the later 1 2 3, not the first
    assert PromptLookup().draft(tokens, 10) == (3, [7, 8, 6, 0, 1, 2, 3])  # up to the end


def test_the_longest_matching_ngram_chooses():
    # "3 4" was followed by 5, but "2 3 4" (longer) by 6.
    tokens = [2, 3, 4, 6, 0, 9, 3, 4, 5, 1, 2, 3, 4]
    assert PromptLookup().draft(tokens, 1) == (3, [6])


def test_no_match_no_draft_and_the_index_grows_with_the_tokens():
    lookup = PromptLookup()
    tokens = [5, 6, 7, 8]
    assert lookup.draft(tokens, 4) == (0, [])
    tokens += [5, 6]
    assert lookup.draft(tokens, 4) == (2, [7, 8, 5, 6])


def test_answers_draft_the_likeliest_continuation_while_they_agree():
    index = SuffixIndex()
    prompt = list(range(100, 120))  # its last 16 tokens are the answers' first context
    for answer in ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9, 9]):
        index.add("a", prompt, answer)
    # 5 followed "1 2 3 4" twice in three: drafted; after "2 3 4 5" all agree on 6 7.
    assert index.draft("a", prompt, 10) == (16, [1, 2, 3, 4, 5, 6, 7])
    index.add("a", prompt, [1, 2, 3, 4, 8])  # now 5 follows in two of four: still half
    assert index.draft("a", prompt, 10)[1] == [1, 2, 3, 4, 5, 6, 7]
    index.add("a", prompt, [1, 2, 3, 4, 8])  # two of five: the draft stops before it
    assert index.draft("a", prompt, 10)[1] == [1, 2, 3, 4]
    # From the middle of another answer: the last 4 tokens match, not 8 or 16.
    assert index.draft("a", [50, 51, 4, 5, 6, 7, 1, 2, 3, 4, 5], 2) == (4, [6, 7])


def test_answers_are_kept_per_namespace_and_the_oldest_forgotten():
    index = SuffixIndex(capacity=10)
    prompt = [7] * 16
    index.add("a", prompt, [1, 2, 3, 4, 5, 6])
    assert index.draft("b", prompt, 4) == (0, [])  # another tenant's answers are never drafted
    index.add("b", prompt, [1, 2, 3, 4, 5, 6])  # 12 tokens: "a"'s answer is forgotten
    assert index.draft("a", prompt, 4) == (0, [])
    assert index.draft("b", prompt, 4) == (16, [1, 2, 3, 4])
    index.add("b", prompt, [9] * 10)
    assert index.draft("b", prompt, 4) == (16, [9, 9, 9, 9])
    index.add("b", prompt, [9] * 11)  # beyond capacity alone: nothing of it is kept
    assert index._size == 0 and not index._counts


def test_with_many_streams_only_an_expected_output_drafts():
    """Beyond MAX_DRAFTING_STREAMS decoding together a lookup's even chance is not worth
    every stream's row; a prediction or an earlier answer, nearly always right, is."""
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]  # a prompt of five, three generated
    drafter = Drafter()
    assert drafter.draft(tokens, 3, worth=0.1, limit=3) == [4, 5, 1]  # prompt lookup
    assert drafter.draft(tokens, 3, worth=0.1, limit=4, expected_only=True) == []
    drafter.expected["history"] = PredictedOutput([1, 2, 3, 9, 9])
    assert drafter.draft(tokens, 3, worth=0.1, limit=4, expected_only=True) == [9, 9]
    assert drafter.source == "history"


def test_draft_length_follows_acceptance():
    acceptance = Acceptance()
    start = acceptance.length(0.4, 16)
    for _ in range(5):
        acceptance.record(drafted=8, accepted=8)
    assert acceptance.length(0.4, 16) > start
    assert acceptance.length(0.4, 3) == 3  # never past its limit
    failing = Acceptance()
    for _ in range(4):
        failing.record(drafted=2, accepted=0)
    assert failing.length(0.4, 16) == 0  # drafts that keep failing stop


def test_a_draft_row_must_be_likelier_the_more_streams_wait_for_the_step():
    cost = StepCost(fixed=0.008, per_decode=0.006, per_prompt=0.004)
    worth = [draft_row_worth(cost, n, 0) for n in (1, 2, 4, 8, 16)]
    assert worth == sorted(worth) and worth[0] < 0.5 < worth[-1] <= 1.0
    assert draft_row_worth(PRIOR, 1, 0) < draft_row_worth(PRIOR, 8, 0)


# ----- the engine ------------------------------------------------------------------------------

def _chat_tokens(local_model, messages) -> list[int]:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return local_model.tokenize(text + "<|im_start|>assistant\n", add_special=True,
                                parse_special=True)


def _generate(local_model, config: EngineConfig, requests: list[GenerationRequest],
              cancel_after: int | None = None, together: bool = True):
    """Each request's generated tokens (all at once on one engine, or one after another),
    its outputs, and the engine's last snapshot; with `cancel_after`, the last request is
    abandoned after that many outputs. Asserts that nothing is left held."""
    local = LocalEngine.start(local_model, config)

    async def one(request, cancel):
        handle = local.submit(request)
        outputs = []
        async for output in handle.outputs():
            outputs.append(output)
            if cancel is not None and len(outputs) == cancel:
                handle.cancel()
                break
        return outputs

    async def run():
        if not together:
            return [await one(r, None) for r in requests]
        return await asyncio.gather(*(one(r, cancel_after if i == len(requests) - 1 else None)
                                      for i, r in enumerate(requests)))
    try:
        outputs = asyncio.run(run())
        snapshot = local.settled()
        if local.index is not None:
            local.assert_released()
        assert local.engine.cells.used == 0
    finally:
        local.stop()
    return [o[-1].generated for o in outputs], outputs, snapshot


def _greedy(prompt: list[int], max_tokens: int = 120, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, max_tokens=max_tokens,
                             sampler=SamplerSettings(temperature=0.0), **kw)


def _drafts(snapshot) -> dict[str, tuple[int, int]]:
    """Draft source -> (tokens drafted, tokens accepted)."""
    return {source: (drafted, accepted) for source, drafted, accepted in snapshot.drafts}


def test_a_prediction_is_drafted_from_and_counted(local_model):
    """The client's predicted answer: taken while the output follows it, and rejoined after
    an edit; the output is the same with or without it."""
    prompt = _chat_tokens(local_model, CHATS["edit"])
    config = EngineConfig(cache=CacheConfig(enabled=False))
    [plain], _, _ = _generate(local_model, config, [_greedy(prompt)], together=False)
    edited = list(plain)
    edited[len(edited) // 2] = local_model.tokenize(" banana", add_special=False,
                                                    parse_special=False)[0]
    requests = [_greedy(prompt, prediction=tuple(plain)), _greedy(prompt, prediction=tuple(
        edited))]
    generated, outputs, snapshot = _generate(local_model, config, requests, together=False)
    assert generated == [plain, plain]
    exact, off_by_one = (o[-1].usage for o in outputs)
    # All but the first token and the one each verification picks after its whole draft
    # (drafts grow to MAX_DRAFT as they are accepted).
    assert exact.accepted_prediction_tokens >= len(plain) * 0.8
    assert exact.rejected_prediction_tokens == 0
    assert off_by_one.rejected_prediction_tokens > 0
    assert off_by_one.accepted_prediction_tokens >= len(plain) // 2  # past the edit too
    assert _drafts(snapshot)["prediction"][1] == sum(
        u.accepted_prediction_tokens for u in (exact, off_by_one))


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_greedy_output_is_the_same_with_drafts(local_model, deterministic):
    """The default mode's output is a request's own when it runs alone (beside others, the
    batch's shape rounds its logits: docs/architecture.md, Engine modes), so there one at a
    time; the deterministic mode's whatever runs beside it, so there all at once."""
    requests = [_greedy(_chat_tokens(local_model, chat)) for chat in CHATS.values()]
    config = EngineConfig(deterministic=deterministic, speculation=False,
                          cache=CacheConfig(budget_mb=64))
    plain, _, _ = _generate(local_model, config, requests, together=deterministic)
    drafted, outputs, snapshot = _generate(
        local_model, EngineConfig(deterministic=deterministic, speculation=True,
                                  cache=CacheConfig(budget_mb=64)), requests,
        together=deterministic)
    assert drafted == plain
    counts = _drafts(snapshot)
    assert counts["prompt"][1] > 20 and counts["prompt"][0] >= counts["prompt"][1]
    # Several accepted tokens arrive in one output: fewer outputs than tokens.
    assert any(len(o) < len(tokens) for o, tokens in zip(outputs, drafted, strict=True))


def test_seeded_sampling_is_the_same_with_drafts(local_model):
    """A pick at each position in turn, as step by step: the same random draws in order."""
    prompt = _chat_tokens(local_model, CHATS["json"])
    requests = [GenerationRequest(prompt, max_tokens=80, sampler=SamplerSettings(
        temperature=0.7, top_p=0.95, seed=seed)) for seed in (1, 2, 3)]
    config = EngineConfig(speculation=False, cache=CacheConfig(enabled=False))
    plain, _, _ = _generate(local_model, config, requests, together=False)
    drafted, _, snapshot = _generate(local_model, EngineConfig(
        speculation=True, cache=CacheConfig(enabled=False)), requests, together=False)
    assert drafted == plain and _drafts(snapshot)["prompt"][1] > 0


def _chi_squared(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic of two samples over the same categories, and its degrees of
    freedom; categories with fewer than 10 in both together are pooled."""
    pooled_a, pooled_b = Counter(), Counter()
    for key in a.keys() | b.keys():
        rare = a[key] + b[key] < 10
        pooled_a["rare" if rare else key] += a[key]
        pooled_b["rare" if rare else key] += b[key]
    n_a, n_b = sum(pooled_a.values()), sum(pooled_b.values())
    statistic = 0.0
    for key in pooled_a.keys() | pooled_b.keys():
        total = pooled_a[key] + pooled_b[key]
        for count, n in ((pooled_a[key], n_a), (pooled_b[key], n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (count - expected) ** 2 / expected
    return statistic, len(pooled_a.keys() | pooled_b.keys()) - 1


def _chi_squared_critical(df: int, z: float = 3.09) -> float:
    """The statistic's 0.999 quantile (Wilson-Hilferty; z of p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3 if df else 0.0


@pytest.mark.timeout(1200)  # 480 sampled answers, the test's power: a busy machine takes long
def test_sampling_with_drafts_keeps_the_models_distribution(local_model):
    """Apart from seeds (where the draws are the same: see above), sampled tokens with drafts
    follow the distribution without. 240 seeds each at temperature 1, the greedy answer as a
    prediction so that every position is drafted and often rejected: over the positions after
    the first, the tokens with drafts and without pass a chi-squared test (p > 0.001)."""
    prompt = _chat_tokens(local_model, CHATS["json"])
    config = EngineConfig(parallel=MAX_DRAFTING_STREAMS, cache=CacheConfig(budget_mb=64))
    [greedy], _, _ = _generate(local_model, dataclasses.replace(config, speculation=False),
                               [_greedy(prompt, max_tokens=8)])

    def sampled(seeds, **kw):
        return [GenerationRequest(prompt, max_tokens=6, sampler=SamplerSettings(
            temperature=1.0, seed=seed), **kw) for seed in seeds]
    plain, _, _ = _generate(local_model, dataclasses.replace(config, speculation=False),
                            sampled(range(240)))
    drafted, _, snapshot = _generate(local_model, config, sampled(range(1000, 1240),
                                                                  prediction=greedy))
    drafts = _drafts(snapshot)["prediction"]
    assert drafts[1] > 30 and drafts[0] - drafts[1] > 30  # often accepted, often not
    # One test over the positions after the first (their statistics and freedoms added): a
    # verifier that took half of the rejected drafts fails it, where each alone did not.
    tests = [_chi_squared(Counter(t[i] for t in plain if len(t) > i),
                          Counter(t[i] for t in drafted if len(t) > i)) for i in range(1, 6)]
    statistic, df = sum(t[0] for t in tests), sum(t[1] for t in tests)
    assert statistic <= _chi_squared_critical(df), (statistic, df)


def test_preemption_and_cancellation_with_drafts_leave_nothing(local_model):
    # Six edits, two running at a time (drafting stops beyond that), want ~560 cells at once;
    # the context has 384: requests are preempted with drafts planned, and the last is
    # cancelled after a few outputs.
    requests = [_greedy(_chat_tokens(local_model, [
        {"role": "system", "content": f"You are assistant number {i}."}, *CHATS["edit"]]),
        max_tokens=100) for i in range(6)]
    config = EngineConfig(parallel=2, ctx_size=384, batch_tokens=128, speculation=True,
                          cache=CacheConfig(budget_mb=64, block_size=16))
    generated, outputs, snapshot = _generate(local_model, config, requests, cancel_after=3)
    assert snapshot.preemptions > 0 and _drafts(snapshot)["prompt"][1] > 0
    assert all(len(tokens) == 100 or o[-1].finish_reason == "stop"
               for tokens, o in zip(generated[:-1], outputs[:-1], strict=True))


# ----- through the gateway ------------------------------------------------------------------

@pytest.fixture(scope="module")
def speculating(model_path):
    yield from serve(model_path, *DEFAULT_ARGS, "--speculation", "on")


@pytest.fixture(scope="module")
def plain(model_path):
    yield from serve(model_path, *DEFAULT_ARGS, "--speculation", "off")


def _stream_chat(server: GatewayProcess, messages, **extra) -> tuple[str, int]:
    stream = openai_client(server).chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=120, temperature=0,
        stream=True, stream_options={"include_usage": True}, **extra)
    text, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(text), usage.completion_tokens


@pytest.mark.parametrize("workload", list(CHATS))
def test_streamed_answers_equal_the_gateway_without_drafts(speculating, plain, workload):
    got = _stream_chat(speculating, CHATS[workload])
    assert got == _stream_chat(plain, CHATS[workload])
    assert _accepted(speculating) > 0


def _accepted(server: GatewayProcess, source: str | None = "prompt") -> float:
    """Draft tokens accepted from one source, or from all of them (None)."""
    counts = server.labelled("prefixgate_speculative_accepted_tokens_total", "source")
    return sum(counts.values()) if source is None else counts[source]


def test_json_schema_output_stays_valid_with_drafts(speculating):
    schema = {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
        "roles": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "name", "email", "roles"]}
    before = _accepted(speculating, None)
    for _ in range(2):
        text, _ = _stream_chat(speculating, CHATS["json"], response_format={
            "type": "json_schema", "json_schema": {"name": "record", "schema": schema}})
        record = json.loads(text)
        assert set(schema["required"]) <= set(record)
    assert _accepted(speculating, None) > before
    speculating.settled()


def test_predicted_outputs_through_the_sdk(speculating):
    """OpenAI's `prediction`, whole and streamed: the same answer, and usage saying how much
    of the prediction it took."""
    client = openai_client(speculating)
    ask = dict(model=speculating.model_name, messages=CHATS["edit"], max_tokens=120,
               temperature=0)
    answer = client.chat.completions.create(**ask).choices[0].message.content
    predicted = client.chat.completions.create(
        **ask, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > predicted.usage.completion_tokens // 2
    wrong = client.chat.completions.create(**ask, stream=True,
                                           stream_options={"include_usage": True},
                                           prediction={"type": "content", "content": [
                                               {"type": "text", "text": "Nothing like it."}]})
    chunks = list(wrong)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert _accepted(speculating, "prediction") >= details.accepted_prediction_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, prediction={"type": "file", "content": "x"})
    assert caught.value.body["param"].startswith("prediction")
    speculating.settled()


# The JSON copy after other words: not the same prompt, but the same last tokens.
JSON_AGAIN = [{"role": "system", "content": "You are a careful assistant."}, *CHATS["json"]]


def test_earlier_answers_are_drafted_within_their_tenant(model_path, tmp_path):
    """Earlier answers are drafts, in the tenant's own namespace only (another's would answer
    faster: a side channel on its text): the one the cache holds after the same whole prompt
    ("history"), and what followed the same last tokens in the answers given lately
    ("suffix")."""
    keys = tmp_path / "keys"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\n")
    server = GatewayProcess(model_path, *DEFAULT_ARGS, "--api-keys-file", str(keys))
    try:
        def counts() -> tuple[dict[str, float], dict[str, float]]:
            return (server.labelled("prefixgate_speculative_drafted_tokens_total", "source"),
                    server.labelled("prefixgate_speculative_accepted_tokens_total", "source"))

        def ask(key: str, messages: list[dict]) -> tuple[str, dict[str, float],
                                                          dict[str, float]]:
            """The answer, and the draft tokens it took by source: drafted, accepted."""
            before = counts()
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key,
                                   max_retries=0)
            answer = client.chat.completions.create(
                model=server.model_name, messages=messages, max_tokens=100,
                temperature=0).choices[0].message.content
            server.wait_idle()
            after = counts()
            while (now := counts()) != after:  # a worker's last snapshot may land after
                after = now                      # the answer did: read until they hold
            drafted, accepted = ({source: now[source] - then[source] for source in now}
                                 for now, then in zip(after, before, strict=True))
            return answer, drafted, accepted

        first, _, _ = ask("key-a", CHATS["json"])
        # Another tenant's same prompt finds neither a's answer after it nor a's last tokens.
        other_tenant, elsewhere, _ = ask("key-b", CHATS["json"])
        again, _, taken = ask("key-a", CHATS["json"])
        assert first == other_tenant == again
        assert elsewhere["history"] == elsewhere["suffix"] == 0
        # The first answer as far as the cache holds it (whole blocks), drafted and taken.
        assert taken["history"] >= 30
        _, drafted, accepted = ask("key-a", JSON_AGAIN)  # no history: not the same prompt
        assert accepted["suffix"] >= 10, (drafted, accepted)
        server.settled()
    finally:
        server.stop()
