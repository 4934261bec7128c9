"""Malformed requests, generated: every answer is a 4xx in OpenAI's shape (or a 200 when the
mutation happened to stay valid), never a 5xx or a hang, and the server serves on. And every list a
request carries, run past its bound on each API: a 400 in the API's shape naming it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.long_lists import CASES, MESSAGES, body, error_param

ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]
CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded", "",
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
# Everything a client may send except the lengths: a valid mutation must stay short to run.
FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "top_k", "stop", "seed", "n",
          "stream", "stream_options", "logit_bias", "presence_penalty", "response_format",
          "tools", "user", "logprobs", "echo", "min_p", "repetition_penalty", "unknown_field"]


def valid_body(endpoint: str, model: str) -> dict:
    body = {"model": model, "max_tokens": 1, "temperature": 0}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    return body


@st.composite
def requests(draw, model: str) -> tuple[str, bytes, str]:
    endpoint = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.sampled_from(["mutated", "random", "bytes", "nested", "huge", "roles"]))
    body = valid_body(endpoint, model)
    if kind == "mutated":
        for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
            body[field] = draw(json_values)
        # Any field but max_tokens goes: without it a prompt generates up to its whole context
        # (a drawn completion of "Hi" at temperature 1 ran the test past its 300 s).
        if draw(st.booleans()):
            body.pop(draw(st.sampled_from(sorted(set(body) - {"max_tokens"}))), None)
        data = json.dumps(body).encode()
    elif kind == "random":
        data = json.dumps(draw(json_values)).encode()
    elif kind == "bytes":  # invalid UTF-8 among the rest
        data = draw(st.binary(max_size=64)) + b"\xff\xfe"
    elif kind == "nested":
        depth = draw(st.integers(100, 100_000))
        data = b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "huge":  # far past the context, well under the body limit
        content = "many words " * draw(st.integers(50_000, 200_000))
        key = "messages" if "messages" in body else "prompt"
        body[key] = [{"role": "user", "content": content}] if key == "messages" else content
        data = json.dumps(body).encode()
    else:
        body["messages"] = [{"role": draw(st.text(max_size=10)), "content": "Hi"}]
        data = json.dumps(body).encode()
    return endpoint, data, draw(st.sampled_from(CONTENT_TYPES))


def post(base_url: str, endpoint: str, data: bytes, content_type: str) -> tuple[int, bytes]:
    request = urllib.request.Request(base_url + endpoint, data=data, method="POST",
                                     headers={"Content-Type": content_type} if content_type
                                     else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_malformed_requests_get_4xx_in_openai_shape(gateway, model_name):
    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def check(data):
        endpoint, body, content_type = data.draw(requests(model_name))
        status, answer = post(gateway.base_url, endpoint, body, content_type)
        assert status < 500, (status, answer[:300])
        if status >= 400:
            error = json.loads(answer)["error"]
            assert error["message"] and error["type"]

    check()
    assert gateway.health()[0] == 200
    gateway.settled()


def test_every_list_past_its_bound_is_a_400_naming_it(gateway, model_name):
    for case in CASES:
        status, answer = post(gateway.base_url, case.path,
                              json.dumps(body(case, model_name)).encode(), "application/json")
        assert status == 400, (case.name, status, answer[:300])
        answer = json.loads(answer)
        if case.path == MESSAGES:
            assert answer["type"] == "error" and \
                answer["error"]["type"] == "invalid_request_error", case.name
        assert case.param in error_param(case.path, answer), (case.name, answer)
    status, health = gateway.health()
    assert status == 200 and all(w["restarts"] == 0 for w in health["workers"])
    gateway.settled()


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.sampled_from(CASES), min_size=2, max_size=4, unique=True))
def test_lists_past_their_bounds_together_are_still_a_400(gateway, model_name, picks):
    """Several lists past their bounds in one body (those of one API): one 400, never a 5xx."""
    path = picks[0].path
    fields = {}
    for case in picks:
        if case.path == path:
            fields |= case.fields()
    mixed = body(picks[0], model_name) | fields
    status, answer = post(gateway.base_url, path, json.dumps(mixed).encode(), "application/json")
    assert status == 400, answer[:300]


def test_the_bounds_page_lists_every_bound_as_the_code_has_it():
    from pathlib import Path

    from gateway.core import bounds
    page = (Path(__file__).parents[1] / "docs" / "api-bounds.md").read_text()
    listed = {row.split("|")[1].strip(" `"): int(row.split("|")[2])
              for row in page.splitlines() if row.startswith("| `")}
    in_code = {name: value for name, value in vars(bounds).items()
               if name.isupper() and isinstance(value, int)}
    assert listed == in_code


def test_a_list_past_its_bound_is_told_its_own_bound_not_another_branchs():
    """A completion's prompt may be text, strings, ids or lists of ids: too many ids is told
    the ids' bound (pydantic reports every branch's; the list-of-strings' is smaller)."""
    import pytest

    from gateway.core import bounds
    from gateway.core.requests import parse_request
    from gateway.edge.errors import APIError
    from gateway.openai.requests import CompletionRequest
    body = {"model": "m", "prompt": [1] * (bounds.TOKEN_IDS + 1)}
    with pytest.raises(APIError) as refused:
        parse_request(CompletionRequest, json.dumps(body).encode())
    assert refused.value.param == "prompt" and str(bounds.TOKEN_IDS) in refused.value.message


def test_a_large_bodys_long_lists_are_refused_before_any_item_is_validated(monkeypatch):
    """Pydantic builds every item of a list before it counts them (10,001 messages: tens of
    milliseconds of the event loop): a large body's lists are counted first, nested ones too,
    and one within every bound is validated as before."""
    import pytest

    from gateway.anthropic.requests import MessagesRequest
    from gateway.core import bounds
    from gateway.core.requests import parse_request
    from gateway.edge.errors import APIError
    from gateway.openai.requests import ChatCompletionRequest

    def never(*_args, **_kwargs):
        pytest.fail("a list past its bound was validated item by item")

    user = {"role": "user", "content": "x" * 40}
    part = {"type": "text", "text": "x"}
    too_long = {
        "messages": {"model": "m", "messages": [user] * (bounds.MESSAGES + 1)},
        "messages[1].content": {"model": "m", "messages": [
            user, {"role": "user", "content": [part] * (bounds.PARTS + 1)},
            *[user] * 2000]},
    }
    with monkeypatch.context() as patched:
        patched.setattr(ChatCompletionRequest, "model_validate_json", never)
        for param, request in too_long.items():
            data = json.dumps(request).encode()
            assert len(data) > bounds.MEASURED_BODY_BYTES
            with pytest.raises(APIError) as refused:
                parse_request(ChatCompletionRequest, data)
            assert refused.value.param == param, refused.value.message
    blocks = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [part] * bounds.PARTS}] * 20}
    within = parse_request(MessagesRequest, json.dumps(blocks).encode())
    assert len(within.messages) == 20 and len(within.messages[0].content) == bounds.PARTS
