"""OpenAI's Responses words for a generation's outputs: a whole `response` object, or its typed
events, each with a `sequence_number`, as the openai SDK's `responses.stream()` and Codex read
them:

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added, response.output_text.delta...,
    response.output_text.done, response.content_part.done, response.output_item.done
    (or, for a call: output_item.added, function_call_arguments.delta/.done, output_item.done),
    response.completed | response.incomplete | response.failed
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from engine.messages import Output, TokenLogprob, Usage
from gateway.errors import APIError
from gateway.generation import Choice, Event, Wire
from gateway.tools import Toolbox, ToolCall


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesWire(Wire):
    def __init__(self, echo: dict, toolbox: Toolbox | None,
                 namespaced: dict[str, tuple[str, str]], prompt_tokens: int,
                 token_bytes=None, on_done: Callable[[dict, Choice], None] | None = None
                 ) -> None:
        self.echo = echo  # what the response object repeats of its request
        self.toolbox = toolbox
        self.on_done = on_done  # called with the finished response (to store it)
        self.namespaced = namespaced  # offered name -> (namespace, name)
        self.prompt_tokens = prompt_tokens
        self.token_bytes = token_bytes  # set when logprobs were asked for (include)
        self.id = _id("resp")
        self.created_at = int(time.time())
        self._sequence = 0
        self._message_id = _id("msg")
        self._open = False  # a message item is being streamed

    # The whole object --------------------------------------------------------------------

    def response(self, status: str, output: list[dict], usage: Usage | None = None,
                 error: APIError | None = None) -> dict:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status,
            "error": {"code": error.code or "server_error", "message": error.message}
            if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "output": output,
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens},
            **self.echo}

    def whole(self, choices: list[Choice], usage: Usage) -> dict:
        return self._done(choices[0])

    def _done(self, choice: Choice) -> dict:
        done = self.response(_status(choice), self._items(choice, "completed"), choice.usage)
        if self.on_done is not None:
            self.on_done(done, choice)
        return done

    def _items(self, choice: Choice, status: str) -> list[dict]:
        call = self._call(choice)
        if call is not None:
            return [self._call_item(call)]
        return [self._message(choice.text, choice.logprobs, status)]

    def _call(self, choice: Choice) -> ToolCall | None:
        if self.toolbox is not None and choice.tool_call is None and not choice.texting:
            choice.tool_call = self.toolbox.parse(choice.text, choice.finish_reason)
        return choice.tool_call

    def _message(self, text: str, logprobs: list[TokenLogprob], status: str) -> dict:
        return {"type": "message", "id": self._message_id, "status": status,
                "role": "assistant", "content": [self._part(text, logprobs)]}

    def _part(self, text: str, logprobs: list[TokenLogprob]) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self._logprobs(logprobs)}

    def _logprobs(self, entries: list[TokenLogprob]) -> list[dict]:
        if self.token_bytes is None:
            return []

        def described(token: int, logprob: float) -> dict:
            data = self.token_bytes(token)
            return {"token": data.decode(errors="replace"), "logprob": logprob,
                    "bytes": list(data)}

        return [{**described(e.token, e.logprob),
                 "top_logprobs": [described(t, lp) for t, lp in e.top]} for e in entries]

    # The stream --------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> Event:
        event = Event({"type": kind, "sequence_number": self._sequence, **fields}, kind)
        self._sequence += 1
        return event

    def opening(self, n_choices: int) -> list[Event]:
        started = self.response("in_progress", [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def on_output(self, index: int, output: Output, choice: Choice) -> list[Event]:
        events = []
        streamable = choice.streamable(output, self.toolbox)
        if streamable is not None:
            events += self._text(*streamable)
        if not output.last:
            return events
        call = None if streamable is not None else self._call(choice)
        if call is not None:
            events += self._function_call(call)
        elif not self._open:  # held back to its end, or no text at all
            events += self._text(choice.text, choice.logprobs)
        if self._open:
            item = self._message(choice.text, choice.logprobs, "completed")
            part = item["content"][0]
            events += [
                self._event("response.output_text.done", item_id=self._message_id,
                            output_index=0, content_index=0, text=choice.text,
                            logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=self._message_id,
                            output_index=0, content_index=0, part=part),
                self._event("response.output_item.done", output_index=0, item=item)]
        done = self._done(choice)
        return [*events, self._event(f"response.{done['status']}", response=done)]

    def _text(self, text: str, logprobs: list[TokenLogprob]) -> list[Event]:
        events = []
        if not self._open:
            self._open = True
            events += [
                self._event("response.output_item.added", output_index=0, item={
                    "type": "message", "id": self._message_id, "status": "in_progress",
                    "role": "assistant", "content": []}),
                self._event("response.content_part.added", item_id=self._message_id,
                            output_index=0, content_index=0, part=self._part("", []))]
        if text:
            events.append(self._event("response.output_text.delta", item_id=self._message_id,
                                      output_index=0, content_index=0, delta=text,
                                      logprobs=self._logprobs(logprobs)))
        return events

    def _function_call(self, call: ToolCall) -> list[Event]:
        item = self._call_item(call)
        return [
            self._event("response.output_item.added", output_index=0,
                        item={**item, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=0, delta=call.arguments),
            self._event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=0, arguments=call.arguments),
            self._event("response.output_item.done", output_index=0, item=item)]

    def _call_item(self, call: ToolCall) -> dict:
        """A call as OpenAI returns it; a namespaced function's under its own name, with its
        namespace."""
        namespace, name = self.namespaced.get(call.name, (None, call.name))
        item = {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"),
                "call_id": call.id, "name": name, "arguments": call.arguments,
                "status": "completed" if call.complete else "incomplete"}
        return {**item, "namespace": namespace} if namespace else item

    def failure(self, error: APIError) -> list[Event]:
        return [self._event("response.failed", response=self.response("failed", [], None, error))]


def _status(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


