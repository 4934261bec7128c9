"""Locust users for any OpenAI-compatible endpoint, streaming chat completions.

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000

Besides each request, two custom events per request show in locust's tables and charts:
"TTFT" (its response time is the time to the first token, in ms) and "tokens/s" (its response
time column holds the output tokens per second after the first token, not milliseconds).
Pick the user classes on the command line (e.g. `SharedPrefixUser`); by default all three run.
"""

from __future__ import annotations

import json
import random
import time

from locust import HttpUser, between, task

WORDS = ["river", "stone", "garden", "letter", "market", "bridge", "window", "island", "forest",
         "engine", "cloud", "harbour", "lantern", "violin", "orchard", "glacier", "meadow",
         "canyon", "lighthouse", "archive", "ledger", "voyage"]
SHARED_SYSTEM = ("You are the assistant of a harbour archive. Visitors ask about shipping routes, "
                 "weather records, trade prices and the people who signed each ledger page. ") * 20


def words(n: int) -> str:
    return " ".join(random.choices(WORDS, k=n))


class ChatUser(HttpUser):
    abstract = True
    wait_time = between(0.5, 2.0)
    max_tokens = 32

    def on_start(self) -> None:
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    def stream_chat(self, name: str, messages: list[dict]) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = None
        text: list[str] = []
        tokens = 0
        with self.client.post("/v1/chat/completions", json=body, stream=True,
                              catch_response=True, name=name) as response:
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("error"):
                    response.failure(event["error"].get("message", "error event"))
                    return ""
                for choice in event.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        first = first or time.perf_counter()
                        text.append(content)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            if first is None:
                response.failure("no tokens streamed")
                return ""
            response.success()
        end = time.perf_counter()
        self._event("TTFT", name, (first - start) * 1000)
        if tokens > 1 and end > first:
            self._event("tokens/s", name, (tokens - 1) / (end - first))
        return "".join(text)

    def _event(self, kind: str, name: str, value: float) -> None:
        self.environment.events.request.fire(request_type=kind, name=name, response_time=value,
                                             response_length=0, exception=None, context={})


class SharedPrefixUser(ChatUser):
    """Every user sends the same long system prompt with a question of its own."""

    @task
    def ask(self) -> None:
        self.stream_chat("shared prefix", [
            {"role": "system", "content": SHARED_SYSTEM},
            {"role": "user", "content": f"Tell me about the {words(6)}."}])


class MultiTurnUser(ChatUser):
    """A conversation that resends its whole history each turn, then starts over."""

    turns = 4

    def on_start(self) -> None:
        super().on_start()
        self.history: list[dict] = []

    @task
    def turn(self) -> None:
        if len(self.history) >= 2 * self.turns:
            self.history = []
        self.history.append({"role": "user", "content": f"And what about the {words(8)}?"})
        answer = self.stream_chat("multi-turn", self.history)
        self.history.append({"role": "assistant", "content": answer})


class UniquePromptUser(ChatUser):
    """Nothing to share: the prefix cache's overhead."""

    @task
    def ask(self) -> None:
        self.stream_chat("unique", [{"role": "system", "content": words(12)},
                                    {"role": "user", "content": words(120)}])
