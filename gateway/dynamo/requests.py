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
from gateway.core.requests import Serving, completion_room, sampler_settings
from gateway.dynamo import codec
from gateway.edge.errors import APIError
from gateway.formats.prompts import Pin

PLANNED = "prefixgate"  # the key of a front's plan in Dynamo's extra_args


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
        return cls(tokens, body.get("sampling_options") or {}, body.get("stop_conditions") or {},
                   body.get("output_options") or {}, routing.get("cache_salt") or "", planned)

    def planned_generation(self, serving: Serving) -> GenerationRequest:
        """A front's plan on this request's prompt and namespace, within this node's bounds
        as any request's (the front checked its own)."""
        self._check_tokens(serving.n_vocab)
        planned = self.planned.generation
        return dataclasses.replace(planned, prompt_tokens=self.token_ids,
                                   namespace=serving.namespace,
                                   max_tokens=self._room(serving, planned.max_tokens))

    def to_generation(self, serving: Serving, stop_tokens: frozenset[int]) -> GenerationRequest:
        """`stop_tokens`: the model's own end-of-generation tokens, where the engine stops."""
        self._check_supported(serving.n_vocab, stop_tokens)
        s, stop = self.sampling, self.stop
        max_tokens = self._room(serving, stop.get("max_tokens"))
        top_k = s.get("top_k")
        return GenerationRequest(
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
