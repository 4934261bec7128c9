"""Several models behind one gateway: both real models here (SmolLM2 135M, a byte-level BPE
Llama, and Gemma 3 270M, SentencePiece with a sliding window), served at once from --model and
--models-dir, each request routed by its `model` to that model's own vocabulary, template,
engine workers and cache."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

from gateway.cli import build_parser, server_config
from gateway.workers.model_files import ModelsError, model_id, served_paths
from gateway.workers.model_store import GEMMA3_270M, default_model_path, model_path
from loadtest.gateway_process import GatewayProcess, scrape
from tests.conftest import openai_client
from tests.test_cache_controls import admin
from tests.test_cache_explain import post

ARGS = ("--parallel", "2", "--ctx-size", "2048", "--temperature", "0")  # greedy by default
ADMIN = "admin-key"
SMOL = default_model_path().stem
GEMMA = model_path(GEMMA3_270M).stem
PROMPT = "The three primary colours are"
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]
# The command line gives every model --ctx-size 2048; [*] takes it to 1536, Gemma's own to 1024.
PRESET = f"""
[*]
ctx-size = 1536

[{GEMMA}]
ctx-size = 1024
model-alias = gemma, gemma-*, claude-haiku-*

[{SMOL}]
cache-share = 3
"""
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """Both models in one directory, SmolLM2 also given as --model (served once)."""
    directory = tmp_path_factory.mktemp("models")
    for path in (default_model_path(), model_path(GEMMA3_270M)):
        (directory / path.name).symlink_to(path)
    return directory


@pytest.fixture(scope="module")
def two(models_dir: Path):
    """Both models with one chat template (ChatML): a conversation renders to the same text on
    each, in each one's own tokens. A preset gives each its own context, Gemma an alias and
    SmolLM2 three quarters of the pool."""
    template = models_dir / "chatml.jinja"
    template.write_text(CHATML)
    preset = models_dir / "presets.ini"
    preset.write_text(PRESET)
    server = GatewayProcess(default_model_path(), *ARGS, "--models-dir", str(models_dir),
                            "--model-alias", "claude-*", "--admin-key", ADMIN,
                            "--chat-template-file", str(template), "--cache-mb", "256",
                            "--models-preset", str(preset))
    yield server
    server.stop()


def tokenize(server: GatewayProcess, text: str, model: str | None) -> list[int]:
    body = {"content": text} | ({"model": model} if model else {})
    status, answer = post(server, "/tokenize", body)
    assert status == 200, answer
    return answer["tokens"]


def greedy(server: GatewayProcess, model: str) -> tuple[str, int]:
    r = openai_client(server).completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                                 temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens


def test_every_model_is_listed_with_its_state(two):
    listed = openai_client(two).models.list().data
    assert [m.id for m in listed] == [SMOL, GEMMA]
    assert all(m.model_extra["status"] == {"value": "loaded"} for m in listed)
    status, health = two.health()
    assert status == 200 and health["models"] == {SMOL: "loaded", GEMMA: "loaded"}
    assert {w["model"] for w in health["workers"]} == {SMOL, GEMMA}


def test_each_request_runs_on_the_model_it_names(two):
    """The same prompt in each model's own tokens, answered by that model's weights: as the
    model answers when it is served alone."""
    smol_tokens, gemma_tokens = tokenize(two, PROMPT, SMOL), tokenize(two, PROMPT, GEMMA)
    assert smol_tokens != gemma_tokens
    assert tokenize(two, PROMPT, None) == smol_tokens  # the first served, without a model
    smol_text, smol_prompt = greedy(two, SMOL)
    gemma_text, gemma_prompt = greedy(two, GEMMA)
    # Gemma's template-free completion prompt starts with <bos>; SmolLM2's adds nothing.
    assert (smol_prompt, gemma_prompt) == (len(smol_tokens), len(gemma_tokens) + 1)
    alone = GatewayProcess(model_path(GEMMA3_270M), *ARGS)
    try:
        assert greedy(alone, GEMMA)[0] == gemma_text
    finally:
        alone.stop()
    assert smol_text != gemma_text


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_chat_messages_and_responses_by_name_whole_and_streamed(two, model):
    client = openai_client(two)
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                           temperature=0)
    assert whole.model == model and whole.choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                                      temperature=0, stream=True)
                       if chunk.choices)
    assert streamed == whole.choices[0].message.content
    claude = anthropic.Anthropic(base_url=two.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=8, messages=CHAT)
    assert message.model == model and message.content[0].text
    with claude.messages.stream(model=model, max_tokens=8, messages=CHAT) as stream:
        assert stream.get_final_message().content[0].text == message.content[0].text
    counted = claude.messages.count_tokens(model=model, messages=CHAT).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens
    response = client.responses.create(model=model, input=CHAT[0]["content"],
                                       max_output_tokens=8, temperature=0)
    assert response.model == model and response.output_text


def test_a_conversation_moves_to_the_other_model(two):
    """previous_response_id across models: the conversation is rendered afresh for the new
    model, then continues on it from its own tokens. Its text on Gemma starts with the stored
    SmolLM2 text (one template): only the model's fingerprint tells that the stored token ids
    are another vocabulary's."""
    client = openai_client(two)
    first = client.responses.create(model=SMOL, input="Remember the word PLUM.",
                                    max_output_tokens=8, temperature=0)
    moved = client.responses.create(model=GEMMA, input="Which word?", max_output_tokens=8,
                                    temperature=0, previous_response_id=first.id)
    rendered = post(two, "/apply-template", {"model": GEMMA, "messages": [
        {"role": "user", "content": "Remember the word PLUM."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Which word?"}]})[1]["prompt"]
    assert moved.usage.input_tokens == len(tokenize(two, rendered, GEMMA))
    again = client.responses.create(model=GEMMA, input="Spell it.", max_output_tokens=8,
                                    temperature=0, previous_response_id=moved.id)
    assert again.usage.input_tokens_details.cached_tokens >= moved.usage.input_tokens - 16


def test_names_aliases_and_unknown_models(two):
    client = openai_client(two)
    aliased = client.chat.completions.create(model="claude-haiku-4-5", messages=CHAT,
                                             max_tokens=4)
    assert aliased.model == "claude-haiku-4-5"
    # `claude-*` is the first model's; Gemma's closer `claude-haiku-*` wins over it.
    assert tokenize(two, PROMPT, "claude-x") == tokenize(two, PROMPT, SMOL)
    assert tokenize(two, PROMPT, "claude-haiku-4-5") == tokenize(two, PROMPT, GEMMA)
    assert tokenize(two, PROMPT, "gemma-3") == tokenize(two, PROMPT, GEMMA)
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=4)


def test_each_model_has_its_own_cache_and_metrics(two):
    client = openai_client(two)
    system = {"role": "system", "content": "You are a terse assistant. " * 30}
    for model in (SMOL, GEMMA):
        for _ in range(2):
            last = client.chat.completions.create(model=model, messages=[system, *CHAT],
                                                  max_tokens=2)
        assert last.usage.prompt_tokens_details.cached_tokens > 100
    computed = two.labelled("prefixgate_prompt_tokens_computed_total", "model")
    assert set(computed) == {SMOL, GEMMA} and all(computed.values())
    for model in (SMOL, GEMMA):
        status, stats = admin(two, "GET", f"/v1/cache/stats?model={model}", ADMIN)
        assert status == 200 and stats["model"] == model and stats["pool"]["blocks_used"]


def test_request_metrics_are_labelled_by_the_served_model(two):
    """Each request's metrics under the id of the model that served it, an alias too; a name
    no model answers to adds no label value (under no model: Prometheus's absent label)."""
    def counts() -> dict[tuple, float]:
        return {(s.name, s.labels.get("model"), s.labels.get("code")): s.value
                for s in scrape(two.base_url) if "le" not in s.labels}

    before = counts()
    openai_client(two).chat.completions.create(model="gemma", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        openai_client(two).chat.completions.create(model="no-such", messages=CHAT, max_tokens=2)
    after = counts()
    grown = {key for key, value in after.items() if value > before.get(key, 0)}
    assert {("prefixgate_requests_total", GEMMA, None),
            ("prefixgate_time_to_first_token_seconds_count", GEMMA, None),
            ("prefixgate_e2e_request_latency_seconds_count", GEMMA, None),
            ("prefixgate_prompt_tokens_total", GEMMA, None),
            ("prefixgate_generation_tokens_total", GEMMA, None),
            ("prefixgate_http_responses_total", GEMMA, "200"),
            ("prefixgate_http_responses_total", "", "404")} <= grown
    assert not any(model == SMOL and name.startswith(("prefixgate_requests_total",
                                                      "prefixgate_time_to_first"))
                   for name, model, _ in grown)
    assert {model for _, model, _ in after} == {None, "", SMOL, GEMMA}


def test_which_files_are_served(tmp_path):
    for name in ("b.gguf", "a-00001-of-00002.gguf", "a-00002-of-00002.gguf", "mmproj-b.gguf",
                 "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    given = tmp_path / "given" / "c.gguf"
    given.parent.mkdir()
    given.write_bytes(b"")
    served = served_paths([given], tmp_path)
    assert [(model_id(p), p.name) for p in served] == [
        ("c", "c.gguf"), ("a", "a-00001-of-00002.gguf"), ("b", "b.gguf")]
    assert served_paths([given, given.parent / ".." / "given" / "c.gguf"], None) == [given]
    (tmp_path / "c.gguf").write_bytes(b"")
    with pytest.raises(ModelsError, match="would both be served as 'c'"):
        served_paths([given], tmp_path)
    with pytest.raises(ModelsError, match="no such file"):
        served_paths([tmp_path / "missing.gguf"], None)


def test_each_model_has_its_preset(two):
    client = openai_client(two)
    assert tokenize(two, PROMPT, "gemma-3") == tokenize(two, PROMPT, GEMMA)
    words = "colour " * 1300  # ~1300 tokens in each vocabulary: past 1024, within 1536
    for model, fits in ((SMOL, True), (GEMMA, False)):
        n = len(tokenize(two, words, model))
        assert 1024 < n < 1500
        if fits:
            assert client.completions.create(model=model, prompt=words, max_tokens=1)
        else:
            with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
                client.completions.create(model=model, prompt=words, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1536"):
        client.completions.create(model=SMOL, prompt=words * 2, max_tokens=1)
    capacity = {model: admin(two, "GET", f"/v1/cache/stats?model={model}", ADMIN)[1]["pool"][
        "bytes_capacity"] for model in (SMOL, GEMMA)}
    assert 2.7 < capacity[SMOL] / capacity[GEMMA] < 3.3  # 192 and 64 MiB of --cache-mb 256


@pytest.mark.parametrize("preset, error", [
    ("[*]\nport = 9\n", "[*]: 'port' is not a model's own setting"),
    ("[nope]\nctx-size = 10\n", "[nope]: no model 'nope' is served"),
    (f"[{SMOL}]\nctx-size = many\n", "invalid int value: 'many'"),
    (f"[{SMOL}]\ndeterministic = maybe\n", "deterministic is a switch"),
    (f"[{SMOL}]\nspeculation = sometimes\n", "invalid choice: 'sometimes'"),
    ("[other]\nmodel = missing.gguf\n", "model = "),
])
def test_a_preset_that_cannot_be_served_is_refused_by_name(tmp_path, capsys, preset, error):
    path = tmp_path / "presets.ini"
    path.write_text(preset)
    parser = build_parser()
    with pytest.raises(SystemExit):
        server_config(parser, parser.parse_args(["--model", str(default_model_path()),
                                                 "--models-preset", str(path)]))
    assert error in capsys.readouterr().err


def test_a_preset_names_a_file_of_its_own_and_switches_its_flags(tmp_path):
    path = tmp_path / "presets.ini"
    path.write_text(f"[tiny]\nmodel = {model_path(GEMMA3_270M)}\nno-flash-attn = true\n"
                    f"temperature = 0.5\n[*]\nparallel = 3\n")
    parser = build_parser()
    config = server_config(parser, parser.parse_args([
        "--model", str(default_model_path()), "--models-preset", str(path),
        "--model-alias", "claude-*", "--temperature", "0.9"]))
    first, tiny = config.models
    assert (first.name, tiny.name) == (SMOL, "tiny")
    assert first.aliases == ("claude-*",) and tiny.aliases == ()
    assert (first.sampling.temperature, tiny.sampling.temperature) == (0.9, 0.5)
    assert first.workers.engine.flash_attn and not tiny.workers.engine.flash_attn
    assert first.workers.engine.parallel == tiny.workers.engine.parallel == 3
