"""Request -> prompt tokens, exactly as llama-cpp-python's `Llama.create_chat_completion` and
`create_completion` build them, so both give the same tokens for the same input."""

from __future__ import annotations

import logging

from llama_cpp import llama_chat_format

from gateway.llama import Model
from gateway.protocol import Message

log = logging.getLogger(__name__)


class PromptBuilder:
    def __init__(self, model: Model, template: str | None = None) -> None:
        self.model = model
        template = template or model.metadata.get("tokenizer.chat_template")
        if template is None:
            log.warning("the model has no chat template in its metadata; using ChatML")
            template = llama_chat_format.CHATML_CHAT_TEMPLATE
        self._formatter = llama_chat_format.Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_text(model.eos_token),
            bos_token=model.token_text(model.bos_token),
            stop_token_ids=[model.eos_token],
        )

    def chat(self, messages: list[Message]) -> list[int]:
        """ValueError when the template refuses the messages (its raise_exception)."""
        # OpenAI's newer "developer" role is a system message to every chat template we serve.
        rendered = self._formatter(messages=[
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ])
        # The template writes any BOS itself, and its special tokens must parse as such.
        return self.model.tokenize(rendered.prompt, add_special=False, parse_special=True)

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < self.model.n_vocab for t in prompt):
                raise ValueError("prompt holds a token id outside the vocabulary")
            return prompt
        if prompt == "":
            if self.model.bos_token < 0:  # nothing to condition on: llama_decode would refuse
                raise ValueError("prompt is empty, and this model has no BOS token to start "
                                 "from")
            return [self.model.bos_token]
        return self.model.tokenize(prompt, add_special=True, parse_special=True)
