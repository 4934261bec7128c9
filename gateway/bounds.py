"""How long each list a request carries may be. Every one costs work per generated token (stop
strings, logit_bias) or per render (messages, their parts, tools, cache breakpoints), so each
has a bound, and a request past one is a 400 naming the field before any work is done: one
request must not stall a worker or the event loop that every other request shares.

Where the API's owner documents a bound, it is that one (OpenAI's 4 stop strings, 16 metadata
pairs; Anthropic's 4 cache breakpoints); elsewhere it is far above what the SDKs and agent
clients send. docs/api-bounds.md lists them; a test keeps that page and these in step.
"""

from __future__ import annotations

from pydantic import Field

from gateway.errors import invalid

STOP_STRINGS = 4  # chat and completions' `stop` (OpenAI's bound)
STOP_SEQUENCES = 64  # Anthropic's `stop_sequences` (it documents none)
STOP_CHARS = 4096  # the characters of one request's stop strings together, on every API
CACHE_BREAKPOINTS = 4  # Anthropic's blocks with cache_control (its own bound)
MESSAGES = 10_000  # chat messages, Anthropic messages, Responses input items
PARTS = 1_000  # content parts (or blocks) of one message, system blocks, tool calls of a turn
TOOLS = 512  # tools offered, a namespace's functions counted one by one
LOGIT_BIAS = 1_024  # token biases
METADATA = 16  # metadata pairs (OpenAI's bound)
INCLUDE = 32  # Responses' `include` values
# Token ids of a completion's prompt or a /detokenize request: past the longest context a
# local model serves, and ~45 ms of validation on the event loop at the most.
TOKEN_IDS = 1 << 18


def at_most(n: int):
    """The Field of a list (or dict) of at most `n` entries: pydantic refuses a longer one as
    it reads it, with the field's name."""
    return Field(max_length=n)


def check_stop_strings(stops: list[str], param: str) -> None:
    """The stop strings' total length: each costs the engine nothing per token
    (engine/textstream.py matches them all at once), but building their matcher is linear."""
    total = sum(len(s) for s in stops)
    if total > STOP_CHARS:
        raise invalid(f"'{param}' holds {total} characters in all; at most {STOP_CHARS} are "
                      "allowed", param)
