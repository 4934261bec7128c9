"""OpenAI's Responses words for a generation's outputs: a whole `response` object, or its typed
events, each with a `sequence_number`, as the openai SDK's `responses.stream()` and Codex read
them:

    response.created, response.in_progress,
    then for each output item (reasoning, message, function_call, in the answer's order):
    response.output_item.added, [response.content_part.added],
    response.reasoning_text.delta... | output_text.delta... | function_call_arguments.delta...,
    their .done, [response.content_part.done], response.output_item.done;
    then response.completed | response.incomplete | response.failed
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from engine.messages import Output, TokenLogprob, Usage
from gateway.core.generation import Choice, Event, Growth, Wire
from gateway.edge.errors import APIError
from gateway.formats.chat_formats import OutputParser, Part


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesWire(Wire):
    def __init__(self, echo: dict, parser: OutputParser | None,
                 namespaced: dict[str, tuple[str, str]], prompt_tokens: int,
                 token_bytes=None, on_done: Callable[[dict, Choice], None] | None = None
                 ) -> None:
        self.echo = echo  # what the response object repeats of its request
        self.parser = parser
        self.on_done = on_done  # called with the finished response (to store it)
        self.namespaced = namespaced  # offered name -> (namespace, name)
        self.prompt_tokens = prompt_tokens
        self.token_bytes = token_bytes  # set when logprobs were asked for (include)
        self.id = _id("resp")
        self.created_at = int(time.time())
        self._sequence = 0
        self._open_at: int | None = None  # the output item being streamed

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
        items = [self._item(i, part, choice, "completed") for i, part in enumerate(choice.parts)]
        done = self.response(_status(choice), items or [
            self._message(0, "", choice.logprobs, "completed")], choice.usage)
        if self.on_done is not None:
            self.on_done(done, choice)
        return done

    def _item(self, index: int, part: Part, choice: Choice, status: str) -> dict:
        """A part as an output item: reasoning, message or function_call."""
        if part.kind == "call":
            return self._call_item(part)
        if part.kind == "reasoning":
            return {"type": "reasoning", "id": self._item_id("rs", index), "summary": [],
                    "content": [{"type": "reasoning_text", "text": part.text}],
                    "status": status}
        return self._message(index, part.text, choice.logprobs, status)

    def _item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.id.removeprefix('resp_')}_{index}"

    def _message(self, index: int, text: str, logprobs: list[TokenLogprob], status: str
                 ) -> dict:
        return {"type": "message", "id": self._item_id("msg", index), "status": status,
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

    def on_output(self, index: int, output: Output, choice: Choice,
                  growth: list[Growth]) -> list[Event]:
        """Each part an output item, opened when it begins, closed when the next begins (or
        the answer ends); its text or arguments streamed as they grow."""
        events = []
        for g in growth:
            at = g.index
            if g.new:
                events += self._close(choice) + self._open(at, g.part, choice)
            if g.delta:
                events.append(self._grown(at, g.part, g.delta, choice))
        if output.last:
            if not choice.parts:  # no answer at all: an empty message, as OpenAI sends one
                choice.parts.append(Part("text"))
                events += self._open(0, choice.parts[0], choice)
            events += self._close(choice)
            done = self._done(choice)
            events.append(self._event(f"response.{done['status']}", response=done))
        return events

    def _open(self, at: int, part: Part, choice: Choice) -> list[Event]:
        self._open_at = at
        item = self._item(at, Part(part.kind, "", part.name, part.id), choice, "in_progress")
        item["status"] = "in_progress"
        if part.kind != "call":
            item["content"] = []
        events = [self._event("response.output_item.added", output_index=at, item=item)]
        if part.kind == "text":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=at, content_index=0,
                                      part=self._part("", [])))
        return events

    def _grown(self, at: int, part: Part, delta: str, choice: Choice) -> Event:
        if part.kind == "call":
            return self._event("response.function_call_arguments.delta",
                               item_id=self._call_item(part)["id"], output_index=at,
                               delta=delta)
        if part.kind == "reasoning":
            return self._event("response.reasoning_text.delta",
                               item_id=self._item_id("rs", at), output_index=at,
                               content_index=0, delta=delta)
        return self._event("response.output_text.delta", item_id=self._item_id("msg", at),
                           output_index=at, content_index=0, delta=delta,
                           logprobs=self._logprobs(choice.new_logprobs()))

    def _close(self, choice: Choice) -> list[Event]:
        """The events that end the open item, whole."""
        at, self._open_at = self._open_at, None
        if at is None:
            return []
        part = choice.parts[at]
        item = self._item(at, part, choice, "completed")
        if part.kind == "call":
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=at, arguments=part.text)]
        elif part.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=at, content_index=0, text=part.text)]
        else:
            content = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"],
                                  output_index=at, content_index=0, text=part.text,
                                  logprobs=content["logprobs"]),
                      self._event("response.content_part.done", item_id=item["id"],
                                  output_index=at, content_index=0, part=content)]
        return [*events, self._event("response.output_item.done", output_index=at, item=item)]

    def _call_item(self, call: Part) -> dict:
        """A call as OpenAI returns it; a namespaced function's under its own name, with its
        namespace."""
        namespace, name = self.namespaced.get(call.name, (None, call.name))
        item = {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"),
                "call_id": call.id, "name": name, "arguments": call.text,
                "status": "completed" if call.done else "incomplete"}
        return {**item, "namespace": namespace} if namespace else item

    def failure(self, error: APIError) -> list[Event]:
        return [self._event("response.failed", response=self.response("failed", [], None, error))]


def _status(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"
