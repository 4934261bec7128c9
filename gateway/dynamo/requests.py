"""Dynamo's token-level request (its frontend's PreprocessedRequest: prompt tokens, sampling
options, stop conditions, output options) as the generation every API builds, under the same
rules: the sampling it asks for over the server's defaults, the completion room its prompt
leaves. What this server does not do is an error naming it, never ignored.

From prefixgate's own front the request also carries the generation as the front planned it
(`extra_args.prefixgate`: grammar, stop strings, logit bias, prediction, pins...), which the
node runs as it is, within its own bounds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.messages import GenerationRequest
from gateway.core import bounds
from gateway.core.generation import HISTORY_TOKENS
from gateway.core.requests import Serving, completion_room, sampler_settings
from gateway.dynamo import codec
from gateway.edge.auth import SHARED_GROUP
from gateway.edge.errors import APIError
from gateway.formats.prompts import Pin

PLANNED = "prefixgate"  # the key of a front's plan in Dynamo's extra_args
TOP_LOGPROBS = 20  # the most alternatives any API asks for a token (OpenAI's bound)
SALT_CHARS = 1024  # a cache salt's length, at most


class UnsupportedRequest(ValueError):
    """A request this node cannot serve as asked (its message says what)."""


@dataclass(frozen=True)
class DynamoRequest:
    """The fields of a PreprocessedRequest a node reads."""

    token_ids: list[int]
    sampling: dict
    stop: dict
    output: dict
    namespace: str  # the router's cache salt: the tenant's cache namespace
    planned: Planned | None = None  # from prefixgate's front

    @classmethod
    def of(cls, body: dict) -> DynamoRequest:
        tokens = body.get("token_ids")
        if not tokens or not all(isinstance(t, int) for t in tokens):
            raise UnsupportedRequest("the request has no prompt token ids")
        routing = body.get("routing") or {}
        planned = (body.get("extra_args") or {}).get(PLANNED)
        try:
            planned = None if planned is None else codec.decode(Planned, planned)
        except ValueError as exc:
            raise UnsupportedRequest(f"the front's plan does not read: {exc}") from None
        salt = routing.get("cache_salt") or ""
        if not isinstance(salt, str) or len(salt) > SALT_CHARS:
            raise UnsupportedRequest(f"the cache salt is not a string of at most {SALT_CHARS} "
                                     "characters")
        # A front's tenants' namespaces are its own: a request from elsewhere (Dynamo's
        # frontend, whose clients choose their salt) never reads their blocks.
        if planned is None and (salt.startswith("tenant:") or salt == SHARED_GROUP):
            raise UnsupportedRequest(f"the cache salt {salt!r} is the namespace of a prefixgate "
                                     "front's tenants")
        return cls(tokens, body.get("sampling_options") or {}, body.get("stop_conditions") or {},
                   body.get("output_options") or {}, salt, planned)

    def planned_generation(self, serving: Serving) -> GenerationRequest:
        """A front's plan on this request's prompt and namespace, within this node's bounds
        as any request's (the front checked its own)."""
        self._check_tokens(serving.n_vocab)
        planned = self.planned.generation
        _check_plan(planned, serving.n_vocab)
        return dataclasses.replace(planned, prompt_tokens=self.token_ids,
                                   namespace=serving.namespace,
                                   max_tokens=self._room(serving, planned.max_tokens))

    def planned_pins(self, longest: float) -> tuple[Pin, ...]:
        """A front's pins, as a local request's are: one per cache breakpoint and one for the
        whole prompt at most, each for at most `longest` seconds (this node's --pin-hours)."""
        pins = self.planned.pins
        if len(pins) > bounds.CACHE_BREAKPOINTS + 1:
            raise UnsupportedRequest(f"{len(pins)} pins; a request sets at most "
                                     f"{bounds.CACHE_BREAKPOINTS + 1}")
        return tuple(Pin(min(max(p.n_tokens, 0), len(self.token_ids)), min(p.seconds, longest))
                     for p in pins)

    def to_generation(self, serving: Serving, stop_tokens: frozenset[int]) -> GenerationRequest:
        """`stop_tokens`: the model's own end-of-generation tokens, where the engine stops."""
        self._check_supported(serving.n_vocab, stop_tokens)
        s, stop = self.sampling, self.stop
        try:
            max_tokens = self._room(serving, stop.get("max_tokens"))
            top_k = s.get("top_k")
            generation = GenerationRequest(
                prompt_tokens=self.token_ids,
                max_tokens=max_tokens,
                sampler=sampler_settings(
                    serving.sampling, s.get("temperature"), s.get("top_p"),
                    None if top_k is None else max(top_k, 0), s.get("min_p"), seed=s.get("seed"),
                    presence_penalty=s.get("presence_penalty") or 0.0,
                    frequency_penalty=s.get("frequency_penalty") or 0.0,
                    repetition_penalty=s.get("repetition_penalty") or 1.0),
                stop=list(stop.get("stop") or []),
                ignore_eos=bool(stop.get("ignore_eos")),
                min_tokens=stop.get("min_tokens") or 0,
                namespace=serving.namespace,
                logprobs=self.output.get("logprobs"),
            )
            # Every field of the type the engine reads (the codec checks each one's): the
            # frontend's types are Dynamo's, but any peer may send this request.
            codec.decode(GenerationRequest, codec.encode(generation))
        except (TypeError, ValueError) as exc:
            raise UnsupportedRequest(f"a field of the request has the wrong type: {exc}"
                                     ) from None
        _check_plan(generation, serving.n_vocab)
        return generation

    def _check_supported(self, n_vocab: int, stop_tokens: frozenset[int]) -> None:
        s = self.sampling
        self._check_tokens(n_vocab)
        if (s.get("n") or 1) != 1 or (s.get("best_of") or 1) != 1:
            raise UnsupportedRequest("n and best_of above 1 are not supported by a prefixgate "
                                     "node: send one request per choice")
        if s.get("use_beam_search"):
            raise UnsupportedRequest("beam search is not supported by a prefixgate node")
        if s.get("guided_decoding"):
            raise UnsupportedRequest("guided decoding through Dynamo is not supported by a "
                                     "prefixgate node")
        if self.output.get("prompt_logprobs"):
            raise UnsupportedRequest("prompt_logprobs are not supported by a prefixgate node")
        # The engine stops at the model's own end-of-generation tokens, which is what the
        # frontend asks for (config.json's eos_token_id lists them): another id it cannot.
        others = set(self.stop.get("stop_token_ids_hidden") or []) - stop_tokens
        if others and not self.stop.get("ignore_eos"):
            raise UnsupportedRequest(f"stop token ids {sorted(others)} are not the model's "
                                     "end-of-generation tokens, the only ones a prefixgate node "
                                     "stops at")

    def _room(self, serving: Serving, wanted: int | None) -> int:
        """The completion tokens the request gets on this node (core.requests.completion_room)."""
        try:
            return completion_room(len(self.token_ids), serving.seq_len, wanted,
                                   serving.max_tokens, "token_ids")
        except APIError as exc:
            raise UnsupportedRequest(exc.message) from None

    def _check_tokens(self, n_vocab: int) -> None:
        if any(not 0 <= t < n_vocab for t in self.token_ids):
            raise UnsupportedRequest(f"a prompt token id is not below the vocabulary's {n_vocab}")


def _check_plan(plan: GenerationRequest, n_vocab: int) -> None:
    """A generation within what a local request may ask (gateway/core/bounds.py): a peer on
    Dynamo's request plane makes a node do nothing its own API would refuse. Every token id
    the engine may decode or index by is in the vocabulary; every list is bounded."""
    if plan.sampler.script:
        raise UnsupportedRequest("a scripted output is a local test hook, not a front's plan")
    if len(plan.stop) > bounds.STOP_SEQUENCES or \
            sum(len(s) for s in plan.stop) > bounds.STOP_CHARS:
        raise UnsupportedRequest(f"at most {bounds.STOP_SEQUENCES} stop strings of "
                                 f"{bounds.STOP_CHARS} characters in all")
    if len(plan.sampler.grammar_triggers) > bounds.STOP_SEQUENCES:
        raise UnsupportedRequest(f"at most {bounds.STOP_SEQUENCES} grammar triggers")
    if len(plan.logit_bias) > bounds.LOGIT_BIAS:
        raise UnsupportedRequest(f"at most {bounds.LOGIT_BIAS} token biases")
    if plan.logprobs is not None and not 0 <= plan.logprobs <= TOP_LOGPROBS:
        raise UnsupportedRequest(f"logprobs must be between 0 and {TOP_LOGPROBS}")
    if len(plan.history) > HISTORY_TOKENS or len(plan.prediction) > bounds.TOKEN_IDS:
        raise UnsupportedRequest(f"a draft source is longer than {HISTORY_TOKENS} (history) "
                                 f"or {bounds.TOKEN_IDS} (prediction) tokens")
    for name, ids in (("logit_bias", plan.logit_bias), ("shown_tokens", plan.shown_tokens),
                      ("prediction", plan.prediction), ("history", plan.history)):
        if any(not 0 <= t < n_vocab for t in ids):
            raise UnsupportedRequest(f"a token id of the plan's {name} is not below the "
                                     f"vocabulary's {n_vocab}")


@dataclass(frozen=True)
class Planned:
    """What prefixgate's front sends a node besides Dynamo's own fields: the generation as
    planned (its prompt is the request's `token_ids`, its namespace the cache salt) and its
    pins, which the node sets on its pool."""

    generation: GenerationRequest
    pins: tuple[Pin, ...] = ()

    def extra_args(self) -> dict:
        bare = dataclasses.replace(self.generation, prompt_tokens=[])  # sent once, as token_ids
        return {PLANNED: codec.encode(dataclasses.replace(self, generation=bare))}
