"""The model directory Dynamo registers a worker's model with, made from the GGUF: Dynamo reads
a Hugging Face layout (config.json, tokenizer.json, tokenizer_config.json with the chat
template), never a .gguf. Written once per GGUF into a cache directory named by its content,
then reused."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cache.fingerprint import gguf_fingerprint
from engine.llama import Model
from gateway.formats.builtin_templates import TEMPLATE_OF_ARCHITECTURE

if TYPE_CHECKING:
    from gateway.dynamo.vocab import Vocabulary

log = logging.getLogger(__name__)

# Jinja for llama.cpp's built-in templates, for a GGUF without a template of its own (the
# gateway renders those in C++, which Dynamo's frontend cannot): the same text, BOS first.
# llama.cpp's "gemma": system text trimmed and put before the first user turn's.
BUILTIN_JINJA = {
    "gemma": (
        "{{ bos_token }}{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}"
        "{% set ns.system = ns.system + (message['content'] | trim) %}"
        "{% else %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' }}"
        "{% if ns.system and role != 'model' %}{{ ns.system + '\\n\\n' }}"
        "{% set ns.system = '' %}{% endif %}"
        "{{ (message['content'] | trim) + '<end_of_turn>\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
}


@dataclass(frozen=True)
class ModelFacts:
    """What the gateway knows of the model besides its vocabulary."""

    architecture: str
    context_length: int  # tokens one request may hold
    stop_tokens: tuple[int, ...]  # every end-of-generation token llama.cpp stops at
    chat_template: str | None = None  # --chat-template, over the GGUF's own

    @classmethod
    def of(cls, model: Model, context_length: int, chat_template: str | None = None
           ) -> ModelFacts:
        return cls(model.metadata.get("general.architecture", ""), context_length,
                   tuple(int(t) for t in model.eog_tokens), chat_template)


def default_directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefixgate" / \
        "dynamo-models"


def model_directory(gguf: str, facts: ModelFacts, root: Path | None = None) -> Path:
    """The directory for `gguf` under `root`, written unless there already. A VocabularyError
    when its vocabulary cannot be converted."""
    root = root or default_directory()
    directory = root / f"{gguf_fingerprint(gguf)[:16]}-{facts.context_length}"
    if (directory / "tokenizer.json").exists():
        return directory
    # Imported here: gguf and tokenizers are the `dynamo` extra, which the plain gateway (and
    # its image) does without, and the server imports this module.
    from gateway.dynamo.vocab import Vocabulary, tokenizer_of
    vocab = Vocabulary.read(gguf)
    tokenizer = tokenizer_of(vocab)
    template = facts.chat_template or vocab.chat_template or \
        BUILTIN_JINJA.get(TEMPLATE_OF_ARCHITECTURE.get(facts.architecture, ""))
    if template is None:
        log.warning("the GGUF has no chat template and none is known for %r: Dynamo's frontend "
                    "serves completions only", facts.architecture)
    root.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: another node starting on the same GGUF never reads half a
    # directory.
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    tokenizer.save(str(staging / "tokenizer.json"))
    _write_json(staging / "tokenizer_config.json", _tokenizer_config(vocab, facts, template))
    _write_json(staging / "config.json", _config(vocab, facts))
    _write_json(staging / "generation_config.json", {
        "bos_token_id": vocab.bos, "eos_token_id": list(facts.stop_tokens)})
    try:
        staging.rename(directory)
    except OSError:  # written meanwhile by another node
        for path in staging.iterdir():
            path.unlink()
        staging.rmdir()
    log.info("Dynamo's model directory for %s: %s", gguf, directory)
    return directory


def _tokenizer_config(vocab: Vocabulary, facts: ModelFacts, template: str | None) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": facts.context_length,
        "bos_token": vocab.token(vocab.bos),
        "eos_token": vocab.token(vocab.eos),
        "unk_token": vocab.token(vocab.unknown),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
    }
    if template is not None:
        config["chat_template"] = template
    return config


def _config(vocab: Vocabulary, facts: ModelFacts) -> dict:
    return {
        "architectures": [facts.architecture],
        "model_type": facts.architecture,
        "vocab_size": len(vocab.tokens),
        "max_position_embeddings": facts.context_length,
        "bos_token_id": vocab.bos,
        "eos_token_id": list(facts.stop_tokens),
    }


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False))
