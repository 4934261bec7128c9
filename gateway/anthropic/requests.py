"""Anthropic's Messages request bodies, validated strictly, and their translation into the chat
messages and tools the one prompt path renders (gateway/formats/prompts.py).

`thinking` turns a reasoning model's thinking on or off where its template can, and
`output_config.effort` gives its level to a template that takes one; `output_config.format` is
enforced by a grammar, as chat's `response_format`. A top-level `cache_control` is Anthropic's
automatic caching: a breakpoint on the last cacheable block (one of the four). A tool's
`input_examples` are shown to the model in its description. Fields that change nothing for a
local model are accepted and have no effect: `context_management`, `metadata`, `safeguards`,
`service_tier`, `speed`, `inference_geo`, `container`, `diagnostics`, `user_profile_id`,
`workspace_id`, a turn's `output_config`, a tool's `defer_loading`, `allowed_callers` and
`eager_input_streaming`, a tool use's `caller`. What cannot be served (image or document blocks
for a text-only model, server tools and their blocks) is a 400 naming it: user content is never
dropped silently. `thinking` blocks of earlier assistant turns are the model's own reasoning,
rendered back as its template does (most keep only the last turn's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.messages import GenerationRequest
from gateway.core import bounds
from gateway.core.bounds import at_most
from gateway.core.conversation import (
    CalledFunction,
    CalledTool,
    FunctionSpec,
    Message,
    NamedFunction,
    NamedToolChoice,
    Tool,
)
from gateway.core.requests import Generating, Serving, Strict, completion_room, sampler_settings
from gateway.edge.errors import invalid
from gateway.formats.chat_formats import Reasoning
from gateway.formats.structured import Grammar, grammar_for
from gateway.formats.tools import Toolbox

# Claude Code's first system block: a billing line whose value changes with every conversation
# (`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;`). Kept in the
# prompt, it would make every session's prefix differ from every other's within its first
# tokens; it means nothing to a local model.
BILLING_HEADER = "x-anthropic-billing-header:"
DEFAULT_TTL_SECONDS = 300.0
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def seconds(self) -> float:
        return TTL_SECONDS[self.ttl] if self.ttl else DEFAULT_TTL_SECONDS


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[dict], at_most(bounds.PARTS)] | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None
    caller: dict | None = None  # who called it (direct, or a server tool's code): no effect
    toolset_name: str | None = None


class UnservedBlock(BaseModel):
    """A block this server cannot serve: refused by name (check_supported), whatever it holds."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "server_tool_use",
                  "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "mcp_tool_use", "mcp_tool_result", "container_upload", "tool_reference",
                  "browser_state", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "tool_search_tool_result"]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[Annotated[TextBlock | UnservedBlock,
                                            Field(discriminator="type")]],
                             at_most(bounds.PARTS)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # text blocks only, once check_supported passed
            return "\n\n".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock | UnservedBlock, Field(discriminator="type")]


class AnthropicMessage(Strict):
    # Claude Code puts a "system" turn (its environment) after the first user turn.
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], at_most(bounds.PARTS)]
    output_config: dict | None = None  # per-turn effort (Claude Code): no effect here

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) \
            else self.content


class AnthropicTool(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict | None = None  # required of custom tools; server tools have none
    type: str | None = None  # None or "custom"; anything else is a server tool
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None  # a hint for Anthropic's tool search: no effect here
    strict: bool | None = None
    # Which code may call it (server tools' code execution, refused here): no effect.
    allowed_callers: Annotated[list[str], at_most(bounds.PARTS)] | None = None
    eager_input_streaming: bool | None = None  # input is streamed as it is written anyway
    input_examples: Annotated[list[dict], at_most(bounds.PARTS)] | None = None

    def described(self) -> str | None:
        """The description the model reads: with the examples of input, where given."""
        if not self.input_examples:
            return self.description
        examples = "\n".join(json.dumps(e) for e in self.input_examples)
        return f"{self.description or ''}\n\nExamples of input:\n{examples}".lstrip()


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(Strict):
    user_id: str | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None

    def effort_level(self) -> str | None:
        """The level as templates take it (gpt-oss: low, medium, high)."""
        return {"xhigh": "high", "max": "high"}.get(self.effort, self.effort)


class Diagnostics(Strict):
    previous_message_id: str | None = None


@dataclass(frozen=True)
class Breakpoint:
    """A cache_control mark: where it stands (`cut` keeps the request up to it) and its TTL."""

    where: tuple  # ("tools", i) | ("system", i) | ("messages", m, b)
    seconds: float


class CountTokensRequest(Strict):
    """What a prompt is made of: /v1/messages/count_tokens takes this alone."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=bounds.MESSAGES)]
    system: str | Annotated[list[TextBlock], at_most(bounds.PARTS)] | None = None
    tools: Annotated[list[AnthropicTool], at_most(bounds.TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict | None = None  # enabled/disabled: the template's switch, where it has one
    context_management: dict | None = None
    output_config: OutputConfig | None = None
    # Automatic caching: a breakpoint on the last cacheable block, counted among the four.
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None  # one speed here: no effect
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Claude Code's classifier context: no effect here
    safeguards: Annotated[list[dict], at_most(bounds.PARTS)] | None = None
    mcp_servers: Annotated[list[dict], at_most(bounds.TOOLS)] | None = None

    def check_supported(self) -> None:
        if self.mcp_servers:
            raise invalid("'mcp_servers' is not supported by this server", "mcp_servers")
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise invalid(f"tools[{i}]: the server tool `{tool.type}` is not supported by "
                              "this server; give custom tools (name, input_schema)",
                              f"tools[{i}].type")
            if tool.input_schema is None:
                raise invalid(f"tools[{i}].input_schema: Field required",
                              f"tools[{i}].input_schema")
        for m, message in enumerate(self.messages):
            for b, block in enumerate(message.blocks()):
                inner = block.content if isinstance(block, ToolResultBlock) \
                    and isinstance(block.content, list) else [block]
                for unserved in (x for x in inner if isinstance(x, UnservedBlock)):
                    raise invalid(f"messages[{m}].content[{b}]: `{unserved.type}` blocks are "
                                  "not supported by this server (its model reads text only)",
                                  f"messages[{m}].content[{b}]")
        if self.tool_choice is not None and self.tool_choice.type == "tool" \
                and not self.tool_choice.name:
            raise invalid("tool_choice of type 'tool' needs a 'name'", "tool_choice.name")
        # Each breakpoint renders and tokenizes the request again, and pins: Anthropic's bound.
        marks = len(self.breakpoints())
        if marks > bounds.CACHE_BREAKPOINTS:
            raise invalid(f"A maximum of {bounds.CACHE_BREAKPOINTS} blocks with cache_control "
                          f"may be provided. Found {marks}.", "cache_control")

    def system_blocks(self, keep_billing_header: bool) -> list[TextBlock]:
        if self.system is None:
            return []
        blocks = [TextBlock(type="text", text=self.system)] if isinstance(self.system, str) \
            else self.system
        return [b for b in blocks if keep_billing_header
                or not b.text.startswith(BILLING_HEADER)]

    def reasoning(self) -> Reasoning:
        """`thinking` on or off, for a template that can switch it (Qwen3's enable_thinking)."""
        kind = (self.thinking or {}).get("type")
        return Reasoning({"enabled": True, "disabled": False}.get(kind),
                         self.output_config.effort_level() if self.output_config else None)

    def toolbox(self) -> Toolbox | None:
        tools = [Tool(type="function", function=FunctionSpec(
            name=t.name, description=t.described(), parameters=t.input_schema,
            strict=t.strict))
            for t in self.tools or []]
        choice = self.tool_choice
        return Toolbox.of(tools, self._openai_tool_choice(),
                          not (choice is not None and choice.disable_parallel_tool_use))

    def _openai_tool_choice(self) -> object:
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            return "auto"
        if choice.type == "any":
            return "required"
        if choice.type == "none":
            return "none"
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))

    def chat_messages(self, keep_billing_header: bool) -> list[Message]:
        """The conversation as chat messages: the system blocks, then any system turn of the
        conversation, as one system message; tool results as tool messages (before the user's
        text, as Anthropic orders them), tool uses as the assistant's tool calls.

        A system turn is folded into the system message because chat templates render a system
        message only first (many refuse one elsewhere), and a small model answers the last
        message it sees: Claude Code sends its environment as a system turn after the question,
        and, rendered there, the model described the environment instead of answering."""
        system = [b.text for b in self.system_blocks(keep_billing_header)]
        for message in self.messages:
            if message.role == "system":
                system += [b.text for b in message.blocks() if isinstance(b, TextBlock)]
        turns = [Message(role="system", content="\n\n".join(system))] if system else []
        for message in self.messages:
            blocks = message.blocks()
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if message.role == "system":
                continue
            if message.role == "user":
                turns += [Message(role="tool", tool_call_id=b.tool_use_id, content=b.text())
                          for b in blocks if isinstance(b, ToolResultBlock)]
                if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    turns.append(Message(role="user", content="\n\n".join(texts)))
                continue
            calls = [CalledTool(id=b.id, type="function", function=CalledFunction(
                name=b.name, arguments=json.dumps(b.input)))
                for b in blocks if isinstance(b, ToolUseBlock)]
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            turns.append(Message(role="assistant", content="".join(texts),
                                 tool_calls=calls or None, reasoning_content=thinking or None))
        return turns

    def breakpoints(self) -> list[Breakpoint]:
        """Every cache_control mark, in prompt order (tools, system, messages), and last the
        top-level one's (automatic caching), on the last cacheable block."""
        marks = [Breakpoint(("tools", i), t.cache_control.seconds)
                 for i, t in enumerate(self.tools or []) if t.cache_control]
        if isinstance(self.system, list):
            marks += [Breakpoint(("system", i), b.cache_control.seconds)
                      for i, b in enumerate(self.system) if b.cache_control]
        for m, message in enumerate(self.messages):
            if isinstance(message.content, list):
                marks += [Breakpoint(("messages", m, b), block.cache_control.seconds)
                          for b, block in enumerate(message.content) if block.cache_control]
        automatic = self._last_cacheable() if self.cache_control else None
        if automatic is not None:
            marks.append(Breakpoint(automatic, self.cache_control.seconds))
        return marks

    def _last_cacheable(self) -> tuple | None:
        """Where automatic caching puts its breakpoint: the last block of the request that can
        carry cache_control (thinking blocks cannot), messages first, then system, then tools."""
        for m in range(len(self.messages) - 1, -1, -1):
            blocks = self.messages[m].blocks()
            for b in range(len(blocks) - 1, -1, -1):
                if not isinstance(blocks[b], ThinkingBlock | RedactedThinkingBlock):
                    return ("messages", m, b)
        system = self.system_blocks(keep_billing_header=True)
        if system:
            return ("system", len(system) - 1)
        return ("tools", len(self.tools) - 1) if self.tools else None

    def cut(self, where: tuple) -> CountTokensRequest:
        """The request up to and including the marked block: what the prefix up to a
        breakpoint holds (the next part would follow it in the prompt). A tool_choice may name
        a tool past the cut and adds nothing before it: only `none` (no tools) is kept."""
        keep = self.tool_choice if self.tool_choice and self.tool_choice.type == "none" else None
        part, update = where[0], {"tool_choice": keep}
        if part == "tools":
            update |= {"tools": self.tools[: where[1] + 1], "system": None, "messages": []}
        elif part == "system":
            system = self.system_blocks(keep_billing_header=True)
            update |= {"system": system[: where[1] + 1], "messages": []}
        else:
            m, b = where[1], where[2]
            last = self.messages[m].model_copy(
                update={"content": self.messages[m].blocks()[: b + 1]})
            update["messages"] = [*self.messages[:m], last]
        return self.model_copy(update=update)


class MessagesRequest(CountTokensRequest, Generating):
    prompt_param: ClassVar[str] = "messages"
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], at_most(bounds.STOP_SEQUENCES)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    # Accepted, no effect here: one tier, one place, no server tools to run in a container,
    # no cache_miss_reason in the answer.
    service_tier: str | None = None
    inference_geo: str | None = None
    container: str | dict | None = None
    diagnostics: Diagnostics | None = None

    def check_supported(self) -> None:
        super().check_supported()
        bounds.check_stop_strings(self.stop_sequences or [], "stop_sequences")

    def to_generation(self, prompt_tokens: list[int], serving: Serving,
                      calls: Grammar | None) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=completion_room(len(prompt_tokens), serving.seq_len, self.max_tokens,
                                       serving.max_tokens, self.prompt_param),
            sampler=sampler_settings(serving.sampling, self.temperature, self.top_p,
                                     self.top_k, grammar=self.output_grammar(calls)),
            stop=list(self.stop_sequences or []),
            namespace=serving.namespace)

    def output_grammar(self, calls: Grammar | None) -> Grammar | None:
        """A required call's grammar; else output_config.format's; else the calls' lazy one."""
        if calls is not None and not calls.triggers:
            return calls
        fmt = self.output_config.format if self.output_config else None
        if fmt is None:
            return calls
        return Grammar(grammar_for("json_schema", {"name": "output", "schema": fmt.schema_},
                                   param="output_config.format"))
