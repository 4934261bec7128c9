"""Request -> prompt tokens, exactly as llama-cpp-python's `Llama.create_chat_completion` and
`create_completion` build them, so both give the same tokens for the same input."""

from __future__ import annotations

import json
import logging

from llama_cpp import llama_chat_format

from engine.llama import Model
from gateway.protocol import Message
from gateway.tools import Toolbox

log = logging.getLogger(__name__)


class PromptBuilder:
    def __init__(self, model: Model, template: str | None = None) -> None:
        self.model = model
        template = template or model.metadata.get("tokenizer.chat_template")
        if template is None:
            log.warning("the model has no chat template in its metadata; using ChatML")
            template = llama_chat_format.CHATML_CHAT_TEMPLATE
        self.takes_tools = "tools" in template
        self._formatter = llama_chat_format.Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_text(model.eos_token),
            bos_token=model.token_text(model.bos_token),
            stop_token_ids=[model.eos_token],
        )

    def chat(self, messages: list[Message], toolbox: Toolbox | None = None) -> list[int]:
        """ValueError when the template refuses the messages (its raise_exception)."""
        return self.tokenize_rendered(self.render_chat(messages, toolbox))

    def tokenize_rendered(self, text: str) -> list[int]:
        """Tokens of rendered text: the template writes any BOS itself, and its special tokens
        must parse as such."""
        return self.model.tokenize(text, add_special=False, parse_special=True)

    def render_chat(self, messages: list[Message], toolbox: Toolbox | None = None) -> str:
        """The prompt's text. ValueError when the template refuses the messages."""
        if toolbox is not None and self.takes_tools:
            rendered = self._formatter(messages=[_native(m) for m in messages],
                                       tools=[{"type": "function", "function": f}
                                              for f in toolbox.functions.values()])
        else:
            turns = [_plain(m) for m in messages]
            if toolbox is not None:  # the documented system-prompt format (gateway/tools.py)
                if turns and turns[0]["role"] == "system":
                    turns[0]["content"] += "\n\n" + toolbox.system_text()
                else:
                    turns.insert(0, {"role": "system", "content": toolbox.system_text()})
            rendered = self._formatter(messages=turns)
        # A named call's head follows, as the start of the answer.
        return rendered.prompt + (toolbox.answer_head() if toolbox is not None else "")

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


def _role(message: Message) -> str:
    # OpenAI's newer "developer" role is a system message to every chat template we serve.
    return "system" if message.role == "developer" else message.role


def _native(message: Message) -> dict:
    """A message for a template that renders tools and tool calls itself."""
    turn = {"role": _role(message), "content": message.text()}
    if message.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
            for c in message.tool_calls]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _plain(message: Message) -> dict:
    """A message for a template without tools: a call is its JSON, a result a user turn."""
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                 for c in message.tool_calls]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1
                                                           else calls)}
    if message.role == "tool":
        return {"role": "user", "content": f"Result of tool call {message.tool_call_id}: "
                                           f"{message.text()}"}
    return {"role": _role(message), "content": message.text()}
