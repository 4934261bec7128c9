"""The tools a request offers (`Toolbox`), and the JSON fallback format for models without a
call syntax of their own (gateway/formats/chat_formats.py recognises the others).

A chat template that takes `tools` renders them itself. For one that does not (SmolLM2's), the
tools are described in the system message in this documented format, and earlier calls and
their results are rendered as plain turns:

    You can call tools. To call one, answer with only a JSON object
    {"name": <tool name>, "arguments": {<its arguments>}}. The tools:
    [{"name": ..., "description": ..., "parameters": {<JSON schema>}}, ...]

`tool_choice` `required` (any tool) is enforced with a grammar over that JSON, so even a small
model returns a call whose arguments validate against the tool's parameters. For a named
function the gateway writes the call's head itself (`{"name": ..., "arguments": ` after the
prompt) and the model generates only the arguments, under a grammar of the parameters: no
completion token is spent on the wrapper. With `auto` the model chooses, and an answer that is
such a JSON object for a known tool becomes a call; with `none` the tools are left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.edge.errors import invalid
from gateway.formats.structured import enforceable, grammar_for

TOOL_PROMPT = ("You can call tools. To call one, answer with only a JSON object "
               '{"name": <tool name>, "arguments": {<its arguments>}}. The tools:\n')
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Toolbox:
    """The tools a request offers and how it lets the model use them."""

    functions: dict[str, dict]  # name -> {"name", "description", "parameters"}, as offered
    forced: str | None  # None: the model chooses; "": any tool; a name: that one
    # name -> the schema a call's arguments are held to: a `strict` tool's parameters whole
    # (what no grammar enforces is a 400), another's as far as a grammar enforces them.
    schemas: dict[str, object]
    parallel: bool = True  # several calls in one answer (parallel_tool_calls)

    def held_functions(self) -> dict[str, dict]:
        """The functions with the parameters their calls are held to, for a call grammar."""
        return {name: {**function, "parameters": self.schemas[name]}
                for name, function in self.functions.items()}

    @classmethod
    def of(cls, tools: list | None, tool_choice: object,
           parallel: bool | None = None) -> Toolbox | None:
        """None when there are no tools to offer (or tool_choice is none)."""
        if not tools or tool_choice == "none":
            return None
        functions, schemas = {}, {}
        for tool in tools:
            spec = tool.function
            if spec.name in functions:  # one would shadow the other (a namespace's, say)
                raise invalid(f"Tool names must be unique: '{spec.name}' is offered twice",
                              "tools")
            functions[spec.name] = {"name": spec.name, "description": spec.description or "",
                                    "parameters": spec.parameters or ANY_OBJECT}
            schemas[spec.name] = functions[spec.name]["parameters"] if spec.strict else \
                enforceable(functions[spec.name]["parameters"])
        if tool_choice in (None, "auto"):
            forced = None
        elif tool_choice == "required":
            forced = ""
        else:
            forced = tool_choice.function.name
            if forced not in functions:
                raise invalid(f"tool_choice names '{forced}', which is not among the tools",
                              "tool_choice")
        return cls(functions, forced, schemas, parallel is not False)

    def grammar(self) -> str | None:
        """A grammar over the call's JSON when a call is required; over only the arguments
        when the function is named (the head is the prompt's)."""
        if self.forced is None:
            return None
        if self.forced:
            return grammar_for("json_schema", {"schema": self.schemas[self.forced]},
                               param="tools")
        names = list(self.functions)
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": name},
                                 "arguments": self.schemas[name]}}
                 for name in names]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return grammar_for("json_schema", {"schema": schema}, param="tools")

    def system_text(self, how_to_call: bool = True) -> str:
        """The tools, described in the system message. `how_to_call`: with the JSON format's
        instructions (a model with a call format of its own knows it)."""
        head = TOOL_PROMPT if how_to_call else "You can call these tools:\n"
        return head + json.dumps(list(self.functions.values()))
