"""How long each list a request carries may be. Every one costs work per generated token (stop
strings, logit_bias) or per render (messages, their parts, tools, cache breakpoints), so each
has a bound, and a request past one is a 400 naming the field before any work is done: one
request must not stall a worker or the event loop that every other request shares.

Where the API's owner documents a bound, it is that one (OpenAI's 4 stop strings, 16 metadata
pairs; Anthropic's 4 cache breakpoints); elsewhere it is far above what the SDKs and agent
clients send. docs/api-bounds.md lists them; a test keeps that page and these in step.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from typing import Annotated, Any, Union, get_args, get_origin

from annotated_types import MaxLen
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from gateway.edge.errors import invalid

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
# local model serves.
TOKEN_IDS = 1 << 18
# Bodies past this size have their lists measured before they are validated: pydantic builds
# every item of a list before it counts them (10,001 messages: 30-120 ms of the event loop),
# while a smaller body validates in a few milliseconds whatever it holds.
MEASURED_BODY_BYTES = 64 << 10


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


@dataclass
class _Shape:
    """Where a request's lists sit and how long each may be, merged over a union's branches:
    the largest bound any branch allows (None: some branch allows any length)."""

    bound: int | None = None
    bounded: bool = False  # a list or mapping is among the branches
    items: _Shape | None = None  # a list's items or a mapping's values
    fields: dict[str, _Shape] = field(default_factory=dict)  # a model's, by JSON name


def refuse_long_lists(model: type[BaseModel], body: bytes) -> None:
    """A 400 naming the first list of a large body past the largest bound its field allows,
    measured on the decoded JSON before any item is validated. Pydantic then checks every
    bound exactly (a list of strings' bound where the branch is a list of strings)."""
    if len(body) <= MEASURED_BODY_BYTES:
        return
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return  # pydantic says what is wrong with it, in the API's words
    _measure(data, _model_shape(model), "")


def _measure(value: Any, shape: _Shape, path: str) -> None:
    if isinstance(value, list | dict) and shape.bounded:
        if shape.bound is not None and len(value) > shape.bound:
            raise invalid(f"Invalid value for '{path}': at most {shape.bound} items are allowed, "
                          f"not {len(value)}", path)
        if shape.items is not None:
            items = enumerate(value) if isinstance(value, list) else value.items()
            for key, item in items:
                _measure(item, shape.items, f"{path}[{key}]")
    if isinstance(value, dict):
        for key, item in value.items():
            if (inner := shape.fields.get(key)) is not None:
                _measure(item, inner, f"{path}.{key}" if path else key)


_MODEL_SHAPES: dict[type[BaseModel], _Shape] = {}


def _model_shape(model: type[BaseModel]) -> _Shape:
    if (shape := _MODEL_SHAPES.get(model)) is not None:
        return shape  # also a model met inside itself: its fields are being filled in
    shape = _MODEL_SHAPES[model] = _Shape()
    for name, info in model.model_fields.items():
        inner = _shape(info.annotation, info.metadata)
        if _matters(inner):
            shape.fields[info.alias or name] = inner
    return shape


def _shape(annotation: Any, metadata: list[Any] = ()) -> _Shape:
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *more = get_args(annotation)
        return _shape(base, [*metadata, *more])
    if origin in (Union, types.UnionType):
        merged = _Shape()
        for branch in get_args(annotation):
            merged = _merge(merged, _shape(branch))
        return merged
    if origin in (list, dict):
        items = _shape(get_args(annotation)[-1]) if get_args(annotation) else None
        return _Shape(_max_length(metadata), True, items if items and _matters(items) else None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model_shape(annotation)
    if annotation in (list, dict):
        return _Shape(bounded=True)
    return _Shape()


def _max_length(metadata: list[Any]) -> int | None:
    for meta in metadata:
        for item in meta.metadata if isinstance(meta, FieldInfo) else [meta]:
            if isinstance(item, MaxLen):
                return item.max_length
    return None


def _matters(shape: _Shape) -> bool:
    return shape.bounded or bool(shape.fields)


def _merge(a: _Shape, b: _Shape) -> _Shape:
    if not _matters(a):
        return b
    if not _matters(b):
        return a
    if a.bounded and b.bounded:
        bound = None if a.bound is None or b.bound is None else max(a.bound, b.bound)
    else:
        bound = a.bound if a.bounded else b.bound
    items = a.items if b.items is None else b.items if a.items is None else _merge(a.items, b.items)
    fields = dict(a.fields)
    for key, inner in b.fields.items():
        fields[key] = _merge(fields[key], inner) if key in fields else inner
    return _Shape(bound, a.bounded or b.bounded, items, fields)
