"""The model directory Dynamo's frontend tokenizes with, made from the GGUF (gateway/dynamo/
assets.py): its tokenizer.json gives llama.cpp's token ids on a corpus of special tokens,
digits, Unicode, whitespace and code for both real models (SmolLM2's byte-level BPE, Gemma 3's
SentencePiece), its chat template renders what the gateway renders, and a vocabulary it cannot
convert is an error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer

from engine.llama import Model
from gateway.dynamo.assets import ModelFacts, model_directory
from gateway.dynamo.vocab import Vocabulary, VocabularyError, tokenizer_of
from gateway.formats.builtin_templates import BuiltinTemplate
from gateway.workers.model_store import GEMMA3_270M, default_model_path, model_path

CORPUS = [
    "Hello world",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "a<unused0>b<eos>",
    "1234567890 3.14159 -42 1e10 year 2026, 1,000,000",
    "naïve café — 日本語のテキスト, Ελληνικά, русский, עברית 🤖🚀👩‍👩‍👧",
    "  leading,  double  spaces\n\n\ttabs\t\n   \n\n\n\n trailing   ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\nclass A:\n\tpass\n",
    "<div class=\"x\">&amp;</div> SELECT * FROM t WHERE id = 'x';",
    "It's don't we'll I'd they're YOU'VE",
    "x" * 300,
    " ",
    "",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def converted(request, tmp_path_factory) -> tuple[Model, Path]:
    gguf = default_model_path() if request.param == "smollm2" else model_path(GEMMA3_270M)
    model = Model(str(gguf), vocab_only=True)
    directory = model_directory(str(gguf), ModelFacts.of(model, 4096),
                                tmp_path_factory.mktemp("dynamo"))
    yield model, directory
    model.close()


def test_token_ids_equal_llama_cpps(converted):
    model, directory = converted
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in CORPUS:
        for special in (True, False):
            assert tokenizer.encode(text, add_special_tokens=special).ids == \
                model.tokenize(text, add_special=special, parse_special=True), (text, special)


def test_the_directory_names_the_models_stops_and_template(converted):
    model, directory = converted
    config = json.loads((directory / "config.json").read_text())
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert model.eos_token in config["eos_token_id"]
    assert config["max_position_embeddings"] == 4096
    assert tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == model.token_text(model.eos_token)


def test_a_builtin_template_renders_as_the_gateway_renders_it(converted):
    """Gemma's GGUF has no template: the gateway renders llama.cpp's built-in one in C++, the
    frontend the directory's Jinja copy of it, and both must give the same prompt."""
    model, directory = converted
    builtin = BuiltinTemplate.for_model(model)
    if builtin is None:
        pytest.skip("the GGUF has a template of its own")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(config["chat_template"])
    chat = [{"role": "system", "content": " Be brief. "},
            {"role": "user", "content": "Hi\n"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Count to 3"}]
    rendered = template.render(messages=chat, add_generation_prompt=True,
                               bos_token=config["bos_token"])
    assert rendered == builtin(chat).prompt


def test_an_unknown_vocabulary_is_an_error_naming_it():
    vocab = Vocabulary.read(str(default_model_path()))
    with pytest.raises(VocabularyError, match="'rwkv'"):
        tokenizer_of(Vocabulary(**{**vocab.__dict__, "kind": "rwkv"}))
    with pytest.raises(VocabularyError, match="'tekken'"):
        tokenizer_of(Vocabulary(**{**vocab.__dict__, "pre": "tekken"}))
