"""The engine's own request and output dataclasses (engine/messages.py) as JSON, for Dynamo's
request plane between prefixgate's front and a node: what a front plans (grammar, stops, logit
bias, drafts' prediction, pins...) reaches the node whole, and the node's outputs come back as
the engine's (text cut at stop strings, stop sequence, usage, logprobs), so that the API modules
read the same objects whichever process ran the engine. JSON, never pickle: a node must not run
what a peer on the network sends it.

Each value is decoded by its field's type: dataclasses by field, tuples, lists, frozensets and
dicts (JSON keys are strings) element by element, `X | None` as X or None."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def encode(value: Any) -> Any:
    """A dataclass (or a value inside one) as JSON-ready values."""
    if dataclasses.is_dataclass(value):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def decode(kind: type[T], value: Any) -> T:
    """`value` (from `encode`) as a `kind`; a ValueError when it does not fit."""
    try:
        return _decode(kind, value)
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a {getattr(kind, '__name__', kind)}: {exc}") from None


def _decode(kind: Any, value: Any) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), value)
    if dataclasses.is_dataclass(kind):
        hints = _hints(kind)
        unknown = set(value) - set(hints)
        if unknown:
            raise TypeError(f"unknown fields {sorted(unknown)}")
        return kind(**{name: _decode(hints[name], v) for name, v in value.items()})
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value, strict=True))
    if origin in (list, frozenset):
        return origin(_decode(args[0], v) for v in value)
    if origin is dict:
        return {_decode(args[0], k if args[0] is str else int(k)): _decode(args[1], v)
                for k, v in value.items()}
    if kind is float and isinstance(value, int):
        return float(value)
    if kind is Any or isinstance(value, kind):
        return value
    raise TypeError(f"{value!r} is not a {kind.__name__}")


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    return typing.get_type_hints(kind)
