"""The official OpenAI client against the real gateway: shapes, streaming, sampling controls."""

from __future__ import annotations

import openai
import pytest

from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client
from tests.test_errors import call

HELLO = [{"role": "user", "content": "Say hello to the world."}]


def test_models_lists_the_served_model(client, model_name):
    assert [m.id for m in client.models.list()] == [model_name]


def test_chat_non_streaming(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=16)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_chat_streaming_with_usage(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # As OpenAI streams: the last text, then a chunk of its own with an empty delta and the
    # finish_reason, so that clients keying on that chunk still see every token.
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-2].choices[0].delta.content is None
    assert chunks[-3].choices[0].finish_reason is None and chunks[-3].choices[0].delta.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=12,
                                           temperature=0)
    assert text == whole.choices[0].message.content


def test_streamed_completion_ends_with_a_finish_chunk_of_its_own(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt="Once upon a time",
                                            max_tokens=6, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text == ""
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streaming_without_usage_sends_none(client, model_name):
    chunks = list(client.chat.completions.create(model=model_name, messages=HELLO,
                                                 max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices


def test_completions_non_streaming_and_streaming(client, model_name):
    r = client.completions.create(model=model_name, prompt="One, two, three,", max_tokens=8,
                                  temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    streamed = list(client.completions.create(model=model_name, prompt="One, two, three,",
                                              max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_completion_from_token_ids(client, model_name, local_model):
    prompt = "Hello there, general"
    ids = local_model.tokenize(prompt, add_special=True, parse_special=True)
    by_text = client.completions.create(model=model_name, prompt=prompt, max_tokens=5,
                                        temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5,
                                       temperature=0)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_string_ends_output_before_it(client, model_name):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8,"
    free = client.completions.create(model=model_name, prompt=prompt, max_tokens=20,
                                     temperature=0).choices[0].text
    assert "12" in free, free  # the model counts on; the stop string below must cut it there
    for stream in (False, True):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=20,
                                      temperature=0, stop=["12"], stream=stream)
        choices = [c.choices[0] for c in r] if stream else [r.choices[0]]
        text = "".join(c.text for c in choices)
        assert text == free[: free.index("12")]
        assert choices[-1].finish_reason == "stop"


def test_stop_string_split_across_tokens(client, model_name):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8,"
    free = client.completions.create(model=model_name, prompt=prompt, max_tokens=20,
                                     temperature=0).choices[0].text
    stop = free[4:9]  # spans several tokens of the output
    streamed = client.completions.create(model=model_name, prompt=prompt, max_tokens=20,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == free[: free.index(stop)]


def test_seeded_sampling_is_reproducible(client, model_name):
    def sample(seed):
        return client.chat.completions.create(
            model=model_name, messages=HELLO, max_tokens=24, temperature=1.2, top_p=0.95,
            seed=seed).choices[0].message.content
    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_ignore_eos_and_min_tokens_reach_the_length(client, model_name):
    for extra in ({"ignore_eos": True}, {"min_tokens": 40}):
        r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=40,
                                           temperature=0, extra_body=extra)
        assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"


def test_penalties_and_logit_bias_change_output(client, model_name, local_model):
    base = dict(model=model_name, messages=[{"role": "user", "content": "Repeat: la la la"}],
                max_tokens=20, temperature=0)
    plain = client.chat.completions.create(**base).choices[0].message.content
    penalised = client.chat.completions.create(**base, frequency_penalty=2.0,
                                               presence_penalty=2.0).choices[0].message.content
    assert penalised != plain
    first_token = client.completions.create(model=model_name, prompt="The", max_tokens=1,
                                            temperature=0).choices[0].text
    banned = client.completions.create(model=model_name, prompt="The", max_tokens=1,
                                       temperature=0, logit_bias={
        str(t): -100 for t in local_model.tokenize(first_token, add_special=False,
                                                   parse_special=False)})
    assert banned.choices[0].text != first_token


@pytest.fixture(scope="module")
def small_context_client(model_path):
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "1024")
    yield openai_client(server)
    server.stop()


def test_context_limit_ends_with_length(small_context_client, model_name):
    r = small_context_client.completions.create(model=model_name, prompt="a " * 1000,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 1024


def test_prompt_longer_than_context_is_rejected(small_context_client, model_name):
    try:
        small_context_client.completions.create(model=model_name, prompt="a " * 1500,
                                                max_tokens=4)
    except openai.BadRequestError as exc:
        assert exc.code == "context_length_exceeded"
    else:
        raise AssertionError("accepted a prompt longer than the context")


def test_tokenize_and_detokenize_as_llama_server_has_them(gateway, local_model):
    import json
    import urllib.request

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(gateway.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    text = "Hello from Turku!"
    tokens = post("/tokenize", {"content": text})["tokens"]
    assert tokens == local_model.tokenize(text, add_special=False, parse_special=True)
    pieces = post("/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == tokens and "".join(p["piece"] for p in pieces) == text
    assert post("/detokenize", {"tokens": tokens})["content"] == text


def test_tokenize_and_detokenize_are_bounded(gateway):
    """No more tokens than a prompt may have (at least 64k): beyond, a 400 before the work that
    would hold the event loop. (Before, any size went through, and froze every stream.)"""
    code, body = call(gateway, "/detokenize", {"tokens": [1] * 70_000})
    assert code == 400 and body["error"]["param"] == "tokens"
    code, body = call(gateway, "/detokenize", {"tokens": [12345] * 1_000_000})  # 7 MB of ids
    assert code == 400 and body["error"]["param"] == "tokens"
    code, body = call(gateway, "/tokenize", {"content": "a " * 70_000, "with_pieces": True})
    assert code == 400 and body["error"]["param"] == "content"
    assert call(gateway, "/detokenize", {"tokens": [1] * 1000})[0] == 200


@pytest.mark.parametrize(("args", "limit"), [((), 8192), (("--ctx-size", "9000"), 9000)])
def test_an_explicit_ctx_size_is_honoured_past_the_training_context(model_path, model_name,
                                                                    args, limit):
    """The test model trained on 8,192 tokens. Left at its default (16,384 cells) a request is
    capped there; an explicit --ctx-size 9000 lets one use all 9,000 (before: 8,192 still)."""
    server = GatewayProcess(model_path, "--parallel", "1", *args)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client(server).completions.create(model=model_name, prompt=[100] * 9100,
                                                     max_tokens=1)
        assert refused.value.code == "context_length_exceeded"
        assert f"maximum context length is {limit} tokens" in refused.value.message
    finally:
        server.stop()


def test_the_chat_fields_the_current_sdk_sends_are_accepted(client, model_name):
    """Every field of openai 3.63's chat and completions params that has no meaning here is
    accepted (before, each was a 400 "unknown parameter"): the answer is the one without them."""
    plain = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=8,
                                           temperature=0)
    fields = {"model": model_name, "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": HELLO[0]["content"],
                                      "prompt_cache_breakpoint": {"mode": "explicit"}}]}],
        "service_tier": "priority", "verbosity": "low", "modalities": ["text"],
        "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}
    whole = client.chat.completions.create(**fields)
    assert whole.choices[0].message.content == plain.choices[0].message.content
    chunks = client.chat.completions.create(**fields, stream=True, stream_options={
        "include_usage": True, "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        plain.choices[0].message.content
    refused_before = client.chat.completions.create(model=model_name, max_tokens=4, messages=[
        *HELLO, {"role": "assistant", "content": None, "refusal": "I cannot."}, *HELLO])
    assert refused_before.choices[0].message.content is not None
    completion = client.completions.create(model=model_name, prompt="Once upon a time",
                                           max_tokens=4, stream=True,
                                           stream_options={"include_obfuscation": False})
    assert [c.choices[0].finish_reason for c in completion][-1] == "length"


@pytest.mark.parametrize(("fields", "param"), [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
])
def test_what_would_change_the_answer_is_refused_by_name(client, model_name, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=4, **fields)
    assert refused.value.body["param"] == param
