"""API keys and tenant-isolated caches, admission control, limits, and the faults found in
review, each against the real server on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import aiohttp
import openai
import pytest

from gateway.edge.errors import APIError
from gateway.formats.prompts import PromptBuilder
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client

KEYS = {"key-of-a": "tenant-a", "key-of-b": "tenant-b", "key-of-c": "tenant-c",
        "key-of-d": "tenant-d"}
METRICS_KEY = "metrics-secret"
# ~400 tokens: cold it takes seconds to compute here, cached a fraction of that.
PROMPT = "The lighthouse keeper logged the weather, the ships and the tides every hour. " * 24


def client_for(server: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def keyed_gateway(model_path, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    lines = ["# key tenant", "key-of-a tenant-a",
             f"sha256:{hashlib.sha256(b'key-of-b').hexdigest()} tenant-b"]
    keys_file.write_text("\n".join(lines) + "\n")
    server = GatewayProcess(model_path, "--parallel", "4", "--ctx-size", "4096",
                            "--api-keys-file", str(keys_file), "--metrics-key", METRICS_KEY,
                            "--shared-prefix-tenants", "tenant-c,tenant-d",
                            env={"PREFIXGATE_API_KEYS": "key-of-c tenant-c, key-of-d tenant-d"})
    yield server
    server.stop()


def completion_usage(client: openai.OpenAI, model: str, prompt: str):
    return client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                     temperature=0).usage


def test_a_missing_or_wrong_key_is_a_401_in_openai_shape(keyed_gateway, model_name):
    with pytest.raises(urllib.error.HTTPError) as missing:  # no Authorization header at all
        urllib.request.urlopen(keyed_gateway.base_url + "/v1/models", timeout=5)
    assert missing.value.code == 401
    assert json.loads(missing.value.read())["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as raised:
        client_for(keyed_gateway, "not-a-key").models.list()
    assert raised.value.status_code == 401 and raised.value.body["code"] == "invalid_api_key"
    assert client_for(keyed_gateway, "key-of-b").models.list().data[0].id == model_name
    assert keyed_gateway.health()[0] == 200  # /health stays open


def test_metrics_need_the_metrics_key_and_debug_its_own(keyed_gateway):
    for path in ("/metrics", "/debug/consistency"):
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(keyed_gateway.base_url + path, timeout=5)
        assert raised.value.code == 401
    request = urllib.request.Request(keyed_gateway.base_url + "/debug/consistency", headers={
        "Authorization": f"Bearer {METRICS_KEY}"})
    with pytest.raises(urllib.error.HTTPError) as raised:  # the metrics key is not enough
        urllib.request.urlopen(request, timeout=5)
    assert raised.value.code == 401
    assert keyed_gateway.metrics()["prefixgate_kv_cells_total"] > 0  # sent with the key
    assert keyed_gateway.consistency()["ok"]  # sent with the debug key


@pytest.fixture(scope="module")
def cors_gateway(model_path, tmp_path_factory):
    """CORS on, a key for tenant-x, and no --debug-key (which turns /debug/* off)."""
    keys = tmp_path_factory.mktemp("cors-keys") / "keys"
    keys.write_text("key-x tenant-x\n")
    server = GatewayProcess(model_path, "--parallel", "1", "--ctx-size", "512",
                            "--cors-allow-origin", "https://app.example", "--api-keys-file",
                            str(keys), "--debug-key", "")
    yield server
    server.stop()


def test_debug_is_off_without_its_key(cors_gateway):
    request = urllib.request.Request(cors_gateway.base_url + "/debug/consistency",
                                     headers={"Authorization": "Bearer anything"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert raised.value.code == 404


def test_a_tenant_never_hits_another_tenants_prefix(keyed_gateway, model_name):
    """Tenant B learns nothing: its prompt is computed whole (what makes its first token as
    slow as a cold one's), though tenant A's identical prompt is cached. Asserted on the tokens
    the engine computed rather than on times, which a busy machine blurs."""
    a, b = client_for(keyed_gateway, "key-of-a"), client_for(keyed_gateway, "key-of-b")
    computed = "prefixgate_prompt_tokens_computed_total"
    before = keyed_gateway.metrics()[computed]
    cold = completion_usage(a, model_name, PROMPT)
    warm = completion_usage(a, model_name, PROMPT)
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert warm.prompt_tokens_details.cached_tokens > 300
    after_a = keyed_gateway.metrics()[computed]
    assert after_a - before < 2 * cold.prompt_tokens  # A's second prompt was not computed
    other = completion_usage(b, model_name, PROMPT)
    assert other.prompt_tokens_details.cached_tokens == 0
    assert keyed_gateway.metrics()[computed] - after_a == other.prompt_tokens
    keyed_gateway.settled()


def test_named_tenants_share_one_namespace(keyed_gateway, model_name):
    c, d = client_for(keyed_gateway, "key-of-c"), client_for(keyed_gateway, "key-of-d")
    prompt = "Shared by the harbour's two offices: " + PROMPT
    assert completion_usage(c, model_name, prompt).prompt_tokens_details.cached_tokens == 0
    assert completion_usage(d, model_name, prompt).prompt_tokens_details.cached_tokens > 300


@pytest.fixture(scope="module")
def small_gateway(model_path):
    """Room for 2 running and 2 waiting requests; short token and body limits. Deterministic,
    so that a batched request's output is its output alone. No request timeout: on a busy
    machine the admitted requests of a burst may take long, and must still finish."""
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "4096", "--deterministic",
                            "--max-queue", "2", "--max-tokens", "64", "--max-body-mb", "0.05")
    yield server
    server.stop()


async def _burst(server: GatewayProcess, model: str, n: int) -> list[tuple[int, dict, dict]]:
    async def one(session: aiohttp.ClientSession, i: int):
        async with session.post(server.base_url + "/v1/completions", json={
                "model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}) as r:
            return r.status, dict(r.headers), await r.json()

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def test_an_overload_burst_gets_429s_and_the_admitted_finish_correctly(small_gateway,
                                                                       model_name):
    client = openai_client(small_gateway)
    results = asyncio.run(_burst(small_gateway, model_name, 40))  # ten times the room for 4
    admitted = [(i, body) for i, (status, _, body) in enumerate(results) if status == 200]
    refused = [(headers, body) for status, headers, body in results if status == 429]
    assert len(admitted) + len(refused) == 40 and len(admitted) >= 4 and refused
    for headers, body in refused:
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "rate_limit_error"
    assert small_gateway.labelled("prefixgate_requests_refused_total", "reason") == {
        "capacity": len(refused), "rate_limit": 0}
    assert small_gateway.labelled("prefixgate_http_responses_total", "code")["429"] == \
        len(refused)
    for i, body in admitted:  # each as it would have been alone
        alone = client.completions.create(model=model_name, prompt=f"Story {i}: once upon a time",
                                          max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert body["choices"][0]["text"] == alone.choices[0].text
    metrics = small_gateway.settled()
    assert metrics["prefixgate_kv_pool_bytes_used"] <= metrics["prefixgate_kv_pool_bytes_capacity"]


@pytest.fixture(scope="module")
def timeout_gateway(model_path):
    server = GatewayProcess(model_path, "--parallel", "8", "--ctx-size", "8192",
                            "--request-timeout", "3")
    yield server
    server.stop()


def test_a_request_past_its_timeout_ends_and_frees_everything(timeout_gateway, model_name):
    # A prompt of ~1,900 tokens and 4,000 tokens to write after it: longer than the 3 s allowed
    # on any machine (~1,900 took 8 s here; a machine fast enough for them is not for 4,000
    # decode steps).
    long_prompt = dict(model=model_name, prompt="word " * 1900, max_tokens=4000, temperature=0)
    with pytest.raises(openai.APIStatusError) as raised:
        openai_client(timeout_gateway).completions.create(**long_prompt,
                                                          extra_body={"ignore_eos": True})
    assert raised.value.status_code == 504 and raised.value.body["code"] == "timeout"
    events = stream_events(timeout_gateway, {**long_prompt, "ignore_eos": True, "stream": True})
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
    timeout_gateway.settled()


def stream_events(server: GatewayProcess, body: dict) -> list[dict | str]:
    request = urllib.request.Request(server.base_url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_max_tokens_cap_and_body_size_limit(small_gateway, model_name):
    client = openai_client(small_gateway)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=65)
    assert raised.value.body["param"] == "max_tokens"
    r = client.completions.create(model=model_name, prompt="Hi", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 64
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model=model_name, prompt="x " * 40_000, max_tokens=1)
    assert raised.value.status_code == 413


def test_a_logit_bias_key_of_unicode_digits_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=1,
                                  logit_bias={"²": 5})
    assert raised.value.body["param"] == "logit_bias"


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + "
    "' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")


def test_a_chat_template_that_rejects_the_messages_is_a_400(model_path, model_name, tmp_path):
    template = tmp_path / "mistral.jinja"
    template.write_text(MISTRAL_TEMPLATE)
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--chat-template-file", str(template))
    try:
        client = openai_client(server)
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=model_name, max_tokens=2, messages=[
                {"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}])
        assert "alternate" in raised.value.body["message"]
        assert raised.value.body["param"] == "messages"
        ok = client.chat.completions.create(model=model_name, max_tokens=2, messages=[
            {"role": "user", "content": "Hi"}])
        assert ok.choices[0].finish_reason in ("length", "stop")
    finally:
        server.stop()


def test_an_empty_prompt_for_a_model_without_bos_is_refused():
    model = SimpleNamespace(metadata={"tokenizer.chat_template": "{{ messages }}"},
                            bos_token=-1, eos_token=2, n_vocab=10,
                            token_text=lambda t: "" if t < 0 else "</s>")
    with pytest.raises(APIError, match="no BOS"):
        PromptBuilder(model).completion("")


def test_help_does_not_load_llama_cpp():
    probe = ("import sys\nfrom gateway.cli import build_parser\nbuild_parser().format_help()\n"
             "assert 'llama_cpp' not in sys.modules, 'llama_cpp was imported'")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def test_a_repeatable_flags_environment_twin_is_a_comma_separated_list(monkeypatch):
    """PREFIXGATE_MODEL_ALIAS='claude-*' is one alias (it was one per character: 'c', 'l', ...),
    and several are separated by commas; the command line adds its own."""
    from gateway.cli import build_parser
    monkeypatch.setenv("PREFIXGATE_MODEL_ALIAS", "claude-*")
    assert build_parser().parse_args([]).model_alias == ["claude-*"]
    monkeypatch.setenv("PREFIXGATE_MODEL_ALIAS", "claude-*, gpt-5*")
    assert build_parser().parse_args(["--model-alias", "o3"]).model_alias == \
        ["claude-*", "gpt-5*", "o3"]


def test_per_key_rate_limits_answer_429_with_retry_after(model_path, model_name, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-r tenant-r\nkey-t tenant-t\n")
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--api-keys-file", str(keys), "--rate-limit-rpm", "3",
                            "--rate-limit-tpm", "400")
    try:
        by_requests = client_for(server, "key-r")
        for _ in range(3):
            by_requests.completions.create(model=model_name, prompt="Hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as raised:
            by_requests.completions.create(model=model_name, prompt="Hi", max_tokens=1)
        assert 1 <= int(raised.value.response.headers["Retry-After"]) <= 60
        # Limits are per key: another key's first request is admitted, until its tokens run out.
        by_tokens = client_for(server, "key-t")
        long_prompt = "tokens and more tokens " * 80  # ~320 tokens: one fits in 400, not two
        by_tokens.completions.create(model=model_name, prompt=long_prompt, max_tokens=4)
        with pytest.raises(openai.RateLimitError):
            by_tokens.completions.create(model=model_name, prompt=long_prompt, max_tokens=4)
        # Admitted before any work: a key past its requests gets a 429 even for a prompt whose
        # rendering would have failed (before, the 400 for its length came first).
        with pytest.raises(openai.RateLimitError):
            by_requests.completions.create(model=model_name, prompt="word " * 5000,
                                           max_tokens=1)
        assert server.labelled("prefixgate_requests_refused_total", "reason") == {
            "capacity": 0, "rate_limit": 3}
    finally:
        server.stop()


def test_what_an_abandoned_request_generated_is_charged(model_path, model_name, tmp_path):
    """A stream left after ~150 tokens spent them: the key's next ~300-token prompt no longer
    fits its 400 tokens a minute. (Before, an abandoned request was charged nothing.)"""
    keys = tmp_path / "keys"
    keys.write_text("key-a tenant-a\n")
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--api-keys-file", str(keys), "--rate-limit-tpm", "400")
    try:
        client = client_for(server, "key-a")
        stream = client.completions.create(model=model_name, prompt="Tell a story.",
                                           max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 150:
                break
        stream.close()
        server.wait_idle()
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=model_name, prompt="tokens and more " * 100,
                                      max_tokens=1)
    finally:
        server.stop()


def test_cors_is_off_by_default_and_answers_its_origin_when_on(gateway, cors_gateway):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}

    def options(server: GatewayProcess):
        request = urllib.request.Request(server.base_url + "/v1/chat/completions",
                                         method="OPTIONS", headers=preflight)
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status, r.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers

    status, headers = options(gateway)
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    server = cors_gateway
    status, headers = options(server)  # no key: browsers send none with a preflight
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    assert "POST" in headers["Access-Control-Allow-Methods"]
    with pytest.raises(urllib.error.HTTPError) as refused:  # the API itself still needs one
        urllib.request.urlopen(urllib.request.Request(
            server.base_url + "/v1/models", headers={"Origin": "https://app.example"}),
            timeout=5)
    assert refused.value.code == 401
    assert refused.value.headers["Access-Control-Allow-Origin"] == "https://app.example"


def test_a_timed_out_stream_is_freed_though_its_client_stopped_reading(timeout_gateway,
                                                                       model_name):
    """The client takes nothing after its request: the server's writes block. At the deadline
    everything the request held is freed anyway, and the connection goes. (Before, the final
    error event waited on the socket forever, holding the sequences.)"""
    server = timeout_gateway
    body = json.dumps({"model": model_name, "prompt": "Tell a story.", "max_tokens": 2000,
                       "n": 8, "logprobs": 20, "stream": True, "ignore_eos": True}).encode()
    first_tokens = "prefixgate_time_to_first_token_seconds_count"
    before = server.metrics()[first_tokens]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once, never read
    try:
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        # It ran: its choices wrote their first tokens (seen running, or counted once they had:
        # on a busy machine the 3 s may be over before a look finds them running).
        deadline = time.monotonic() + 60
        while (metrics := server.metrics())["prefixgate_num_requests_running"] < 1 and \
                metrics[first_tokens] == before:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # Freed by the 3 s deadline plus the few seconds the error event may wait (before the
        # fix, never: a wait longer than a busy machine needs fails it just the same).
        metrics = server.wait_idle(timeout=60)
        assert metrics["prefixgate_kv_cells_used"] == 0
        server.settled()
    finally:
        sock.close()
