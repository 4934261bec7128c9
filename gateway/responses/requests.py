"""OpenAI's Responses request bodies (POST /v1/responses), validated strictly, and their
translation into the chat messages and tools the one prompt path renders.

Input items: messages (roles system, developer, user, assistant; `input_text`, `output_text`
and `refusal` parts), `function_call`, `function_call_output`, and `reasoning` items (a model
without reasoning produced none: they are skipped). Leading system and developer messages (and
`instructions`) become one system message, as chat templates render a system message first.

Tools: `function` tools are served; a `namespace` tool's functions are offered to the model as
`<namespace>__<name>` and a call to one comes back with its own name and `namespace`, as OpenAI
names it (a flattened name that another tool has too is a 400). Hosted tools that cannot run
here (web search, file search, code interpreter, computer use, image generation, MCP, shells,
custom grammars: HOSTED_TOOLS) are left out of what the model sees: the client gets an answer,
and the gateway counts and logs them, by type. Any other type is a 400 naming it.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

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
    PromptCacheBreakpoint,
    PromptCacheOptions,
    Tool,
    require_schema_name,
    written_breakpoints,
)
from gateway.core.requests import Generating, Serving, Strict, completion_room, sampler_settings
from gateway.edge.errors import invalid
from gateway.formats.chat_formats import Reasoning
from gateway.formats.structured import Grammar, grammar_for
from gateway.formats.tools import Toolbox

NAMESPACE_SEPARATOR = "__"
LOGPROBS = "message.output_text.logprobs"  # what `include` names to get logprobs
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "web_search_2025_08_26", "file_search", "code_interpreter", "computer",
                "computer_use", "computer_use_preview", "image_generation", "mcp", "local_shell",
                "shell", "apply_patch", "tool_search", "programmatic_tool_calling", "custom")


class InputText(Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None  # pins up to this part


class OutputText(Strict):
    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[Any], at_most(bounds.PARTS)] | None = None
    logprobs: Annotated[list[Any], at_most(bounds.TOKEN_IDS)] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class UnservedPart(BaseModel):
    """A part this server cannot serve: refused by name (check_supported)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]


Part = Annotated[InputText | OutputText | Refusal | UnservedPart, Field(discriminator="type")]


def _part_text(part: InputText | OutputText | Refusal) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


class MessageItem(Strict):
    type: Literal["message"] | None = None  # an "easy" message leaves it out
    id: str | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[Part], at_most(bounds.PARTS)]
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n\n".join(_part_text(p) for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    status: str | None = None
    caller: dict | None = None  # direct, or a program's (programmatic tool calling): no effect

    def offered_name(self) -> str:
        return f"{self.namespace}{NAMESPACE_SEPARATOR}{self.name}" if self.namespace \
            else self.name


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | Annotated[list[Part], at_most(bounds.PARTS)]
    status: str | None = None
    caller: dict | None = None
    name: str | None = None  # the call's, which call_id names already
    namespace: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n\n".join(_part_text(p) for p in self.output)


class ReasoningItem(BaseModel):
    """The model's own reasoning of an earlier turn, rendered back with the assistant turn
    that follows it (as its template does). Codex sends its summary and encrypted content:
    only readable text is kept."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]
    summary: Annotated[list[dict], at_most(bounds.PARTS)] | None = None
    content: Annotated[list[dict], at_most(bounds.PARTS)] | None = None

    def text(self) -> str:
        parts = self.content or self.summary or []
        return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


class UnservedItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(
        value, "type", "message")
    known = ("message", "function_call", "function_call_output", "reasoning")
    return kind if kind in known else "unserved"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[UnservedItem, Tag("unserved")],
    Discriminator(_item_kind)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    # Who may call it (programmatic tool calling, a hosted tool here), what it returns: no effect.
    allowed_callers: Annotated[list[Literal["direct", "programmatic"]],
                               at_most(bounds.PARTS)] | None = None
    output_schema: dict | None = None


class NamespaceTool(Strict):
    type: Literal["namespace"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    tools: Annotated[list[FunctionTool], at_most(bounds.TOOLS)]


class HostedTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace") else "hosted"


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")], Discriminator(_tool_kind)]


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesCacheOptions(PromptCacheOptions):
    comparison_response_id: str | None = None  # cache diagnostics: /v1/cache/explain here
    prewarm: bool | None = None  # no output at all: refused (check_supported)


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # no padding is added here


class ContextManagement(Strict):
    """Compaction once the input reaches `compact_threshold` tokens: never done here, so an
    input that reaches it is a 400 (check_compaction); below it, there is nothing to do."""

    type: str
    compact_threshold: Annotated[int, Field(ge=1)] | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(Generating):
    prompt_param: ClassVar[str] = "input"
    model: str
    input: str | Annotated[list[InputItem], at_most(bounds.MESSAGES)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[ToolSpec], at_most(bounds.TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: Annotated[list[str], at_most(bounds.INCLUDE)] | None = None
    # OpenAI's prompt-cache words: a routing hint, and "24h" pins the prompt's blocks.
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: ResponsesCacheOptions | None = None
    safety_identifier: str | None = None
    user: str | None = None
    metadata: Annotated[dict[str, str], at_most(bounds.METADATA)] | None = None
    reasoning: dict | None = None  # its effort, for a template that takes one (gpt-oss, Qwen3)
    # Accepted, no effect here: one tier, Codex's own bookkeeping, no padding, no images, no
    # access programs; background's options when background itself is refused.
    service_tier: str | None = None
    stream_options: ResponsesStreamOptions | None = None
    image: dict | None = None
    access_programs: dict | None = None
    background_options: dict | None = None
    context_management: Annotated[list[ContextManagement], at_most(bounds.PARTS)] | None = None
    moderation: dict | None = None  # refused: it could block the answer
    # "disabled" is what is done: a prompt past the context is a 400. "auto" (drop the oldest
    # items until it fits) is refused rather than ignored.
    truncation: Literal["auto", "disabled"] | None = None
    client_metadata: dict | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    # Refused when asked for (check_supported): they would change the answer.
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None

    def check_supported(self) -> None:
        prewarm = bool(self.prompt_cache_options and self.prompt_cache_options.prewarm)
        for param, asked in {"truncation": self.truncation == "auto",
                             "background": bool(self.background),
                             "conversation": self.conversation is not None,
                             "prompt": self.prompt is not None,
                             "moderation": self.moderation is not None,
                             "prompt_cache_options.prewarm": prewarm}.items():
            if asked:
                raise invalid(f"'{param}' is not supported by this server", param, "unsupported")
        for i, tool in enumerate(self.tools or []):
            if isinstance(tool, HostedTool) and tool.type not in HOSTED_TOOLS:
                raise invalid(f"tools[{i}].type: `{tool.type}` is not a tool type: a function, "
                              f"a namespace, or one of {', '.join(HOSTED_TOOLS)}",
                              f"tools[{i}].type")
        offered = len(self.functions())
        if offered > bounds.TOOLS:
            raise invalid(f"'tools' offers {offered} functions, namespaces' included; at most "
                          f"{bounds.TOOLS} are allowed", "tools")
        for i, item in enumerate(self.items()):
            if isinstance(item, UnservedItem):
                raise invalid(f"input[{i}]: `{item.type}` items are not supported by this server",
                              f"input[{i}].type")
            parts = item.content if isinstance(item, MessageItem) else \
                item.output if isinstance(item, FunctionCallOutputItem) else ""
            for part in parts if isinstance(parts, list) else []:
                if isinstance(part, UnservedPart):
                    raise invalid(f"input[{i}]: `{part.type}` parts are not supported by this "
                                  "server (its model reads text only)", f"input[{i}].content")

    def check_compaction(self, input_tokens: int) -> None:
        """A 400 when the input reaches a compaction threshold: compaction would change it."""
        for i, entry in enumerate(self.context_management or []):
            if entry.compact_threshold is not None and input_tokens >= entry.compact_threshold:
                raise invalid(f"The input is {input_tokens} tokens, past context_management[{i}]"
                              f".compact_threshold ({entry.compact_threshold}): compaction is "
                              "not supported by this server", f"context_management[{i}]",
                              "unsupported")

    def cache_breakpoints(self) -> list[tuple[int, int, float]]:
        """The input_text parts marked with prompt_cache_breakpoint (written_breakpoints)."""
        return written_breakpoints(
            [(i, p, part.prompt_cache_breakpoint) for i, item in enumerate(self.items())
             if isinstance(item, MessageItem) and isinstance(item.content, list)
             for p, part in enumerate(item.content)
             if isinstance(part, InputText) and part.prompt_cache_breakpoint],
            self.prompt_cache_options)

    def cut(self, i: int, p: int) -> ResponsesRequest:
        """The request whose input ends with part p of item i."""
        items = self.items()
        last = items[i].model_copy(update={"content": items[i].content[: p + 1]})
        return self.model_copy(update={"input": [*items[:i], last]})

    def items(self) -> list:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return self.input

    def input_items(self) -> list[dict]:
        """The input as items with ids, as GET /v1/responses/{id}/input_items lists them."""
        listed = []
        for item in self.items():
            data = item.model_dump(exclude_none=True, by_alias=True)
            if isinstance(item, MessageItem):
                data["type"] = "message"
                if isinstance(item.content, str):
                    data["content"] = [{"type": "input_text", "text": item.content}]
            data.setdefault("id", f"{'msg' if data['type'] == 'message' else 'item'}_"
                                  f"{uuid.uuid4().hex}")
            listed.append(data)
        return listed

    def hosted_tools(self) -> list[str]:
        """The tools left out of what the model sees (they cannot run here)."""
        return [t.type for t in self.tools or [] if isinstance(t, HostedTool)]

    def functions(self) -> list[Tool]:
        """Every function the model is offered, namespaced ones under their offered name."""
        offered = []
        for tool in self.tools or []:
            if isinstance(tool, FunctionTool):
                offered.append(_offered(tool, tool.name))
            elif isinstance(tool, NamespaceTool):
                offered += [_offered(f, f"{tool.name}{NAMESPACE_SEPARATOR}{f.name}")
                            for f in tool.tools]
        return offered

    def namespaced(self) -> dict[str, tuple[str, str]]:
        """Offered name -> (namespace, name) of every namespaced function."""
        return {f"{t.name}{NAMESPACE_SEPARATOR}{f.name}": (t.name, f.name)
                for t in self.tools or [] if isinstance(t, NamespaceTool) for f in t.tools}

    def reasoning_settings(self) -> Reasoning:
        return Reasoning.of_effort((self.reasoning or {}).get("effort"))

    def toolbox(self) -> Toolbox | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        return Toolbox.of(self.functions(), choice, self.parallel_tool_calls)

    def to_generation(self, prompt_tokens: list[int], serving: Serving,
                      calls: Grammar | None) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=completion_room(len(prompt_tokens), serving.seq_len,
                                       self.max_output_tokens, serving.max_tokens,
                                       self.prompt_param),
            sampler=sampler_settings(serving.sampling, self.temperature, self.top_p,
                                     grammar=self.output_grammar(calls)),
            namespace=serving.namespace,
            logprobs=self.logprob_count())

    def logprob_count(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the k likeliest alternatives."""
        if LOGPROBS in (self.include or []) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    def routing_key(self) -> str | None:
        return self.prompt_cache_key

    def keeps_prompt(self) -> bool:
        return self.prompt_cache_retention == "24h"

    def output_grammar(self, calls: Grammar | None) -> Grammar | None:
        """A required call's grammar; else text.format's; else the calls' lazy one."""
        if calls is not None and not calls.triggers:
            return calls
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return calls
        if fmt.type == "json_object":
            return Grammar(grammar_for("json_object", None, param="text.format"))
        schema = {"name": fmt.name, "schema": fmt.schema_ or {}}
        require_schema_name(schema, "text.format.name")
        return Grammar(grammar_for("json_schema", schema, param="text.format"))

    def chat_messages(self, history: list[Message] | None = None) -> list[Message]:
        """The conversation as chat messages: `instructions` and the leading system and
        developer messages as one system message; calls as the assistant's tool calls, their
        outputs as tool messages; reasoning items left out. `history`: a stored response's
        conversation, which this input continues."""
        return with_instructions(self.turns(history), self.instructions)

    def turns(self, history: list[Message] | None = None) -> list[Message]:
        """The conversation without `instructions` (a continuation does not inherit them)."""
        items = list(self.items())  # a copy: its leading system items are taken off
        turns = list(history or [])
        system = []
        while not turns and items and isinstance(items[0], MessageItem) \
                and items[0].role in ("system", "developer"):
            system.append(items.pop(0).text())
        if system:
            turns.append(Message(role="system", content="\n\n".join(system)))
        reasoning = ""  # of the assistant turn that comes next
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning += item.text()
                continue
            if isinstance(item, FunctionCallItem):
                call = CalledTool(id=item.call_id, type="function", function=CalledFunction(
                    name=item.offered_name(), arguments=item.arguments))
                last = turns[-1] if turns else None
                if last is not None and last.role == "assistant":  # a copy: history is shared
                    turns[-1] = last.model_copy(
                        update={"tool_calls": [*(last.tool_calls or []), call]})
                else:
                    turns.append(Message(role="assistant", content="", tool_calls=[call],
                                         reasoning_content=reasoning or None))
                    reasoning = ""
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(Message(role="tool", tool_call_id=item.call_id,
                                     content=item.text()))
            else:
                thought = (reasoning or None) if item.role == "assistant" else None
                turns.append(Message(role=item.role, content=item.text(),
                                     reasoning_content=thought))
                reasoning = "" if item.role == "assistant" else reasoning
        return turns


def with_instructions(turns: list[Message], instructions: str | None) -> list[Message]:
    """`instructions` first in the system message."""
    if not instructions:
        return turns
    if turns and turns[0].role == "system":
        first = turns[0].model_copy(update={"content": f"{instructions}\n\n{turns[0].text()}"})
        return [first, *turns[1:]]
    return [Message(role="system", content=instructions), *turns]


def _offered(tool: FunctionTool, name: str) -> Tool:
    # Responses' function tools are strict unless they say otherwise (OpenAI's default).
    return Tool(type="function", function=FunctionSpec(
        name=name[:64], description=tool.description, parameters=tool.parameters,
        strict=tool.strict is not False))
