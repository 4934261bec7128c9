"""Seeded benchmark workloads: the same prompts for every system under test.

A workload is a list of conversations; a conversation's turns run one after another (each turn
resends the whole history), conversations run concurrently."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.llama import Model

WORDS = [
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child",
    "world", "school", "state", "family", "student", "group", "country", "problem",
    "hand", "part", "place", "case", "week", "company", "system", "program", "question",
    "work", "government", "number", "night", "point", "home", "water", "room", "mother",
    "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye",
    "job", "word", "business", "issue", "side", "kind", "head", "house", "service",
    "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car",
    "city", "community", "name", "president", "team", "minute", "idea", "kid", "body",
    "information", "back", "parent", "face", "others", "level", "office", "door",
    "health", "person", "art", "war", "history", "party", "result", "change", "morning",
    "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education",
    "river", "stone", "garden", "letter", "market", "bridge", "window", "island",
    "forest", "engine", "cloud", "harbour", "lantern", "violin", "orchard", "glacier",
    "meadow", "canyon", "lighthouse",
]


@dataclass
class Conversation:
    system: str | None
    turns: list[str]
    group: int = 0
    response_format: dict | None = None  # structured output: the answer follows a schema


# What the structured-output workload asks for: nested objects, an array, enums, bounds.
RECORD_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["title", "author", "year", "tags", "publisher"],
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "object", "additionalProperties": False, "required": ["name"],
                   "properties": {"name": {"type": "string", "maxLength": 30},
                                  "country": {"type": "string", "maxLength": 20}}},
        "year": {"type": "integer"},
        "tags": {"type": "array", "maxItems": 4,
                 "items": {"enum": ["fiction", "history", "science", "poetry", "travel"]}},
        "publisher": {"type": "string", "maxLength": 30}}}


class TextMaker:
    """Random English-like text of a given length in tokens of the model under test."""

    def __init__(self, model: Model, seed: int) -> None:
        self.model = model
        self.rng = np.random.default_rng(seed)

    def text(self, n_tokens: int) -> str:
        words: list[str] = []
        while self._count(words) < n_tokens:
            words.extend(self.rng.choice(WORDS, size=max(4, (n_tokens - self._count(words)) // 2)))
        while self._count(words) > n_tokens:
            words.pop()
        return " ".join(words).capitalize() + "."

    def _count(self, words: list[str]) -> int:
        return len(self.model.tokenize(" ".join(words), add_special=False, parse_special=False))


def shared_prefix(maker: TextMaker, groups: int, prompts_per_group: int, prefix_tokens: int,
                  question_tokens: int) -> list[Conversation]:
    prefixes = [maker.text(prefix_tokens) for _ in range(groups)]
    conversations = [Conversation(prefixes[g], [maker.text(question_tokens)], group=g)
                     for g in range(groups) for _ in range(prompts_per_group)]
    # Interleave the groups, as users of different apps would arrive.
    order = maker.rng.permutation(len(conversations))
    return [conversations[i] for i in order]


def multi_turn(maker: TextMaker, conversations: int, turns: int, system_tokens: int,
               turn_tokens: int) -> list[Conversation]:
    return [Conversation(maker.text(system_tokens), [maker.text(turn_tokens) for _ in range(turns)],
                         group=c) for c in range(conversations)]


def unique_prompts(maker: TextMaker, n: int, prompt_tokens: int) -> list[Conversation]:
    # A system message of their own too: a chat template's default one would be shared.
    return [Conversation(maker.text(16), [maker.text(prompt_tokens)], group=i) for i in range(n)]


def many_streams(maker: TextMaker, n: int, prompt_tokens: int,
                 question_tokens: int) -> list[Conversation]:
    """n users of one app at once: the app's system prompt, a question of their own each."""
    return shared_prefix(maker, 1, n, prompt_tokens, question_tokens)


def structured(maker: TextMaker, n: int, prompt_tokens: int) -> list[Conversation]:
    """n requests for a JSON record that follows RECORD_SCHEMA, each with its own text."""
    schema = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD_SCHEMA}}
    return [Conversation(maker.text(16), [maker.text(prompt_tokens)
                                          + " Describe a book as a JSON record."], group=i,
                         response_format=schema) for i in range(n)]
