"""Every message that crosses between the gateway process and its engine worker processes.

They travel pickled over one `multiprocessing` connection per worker (a Unix socket pair). The
gateway sends requests and index replies; a worker sends outputs, snapshots and index calls. Only
these plain dataclasses cross: never an engine, a context or a tree.

The cache index (radix tree, block allocation, reference counts, LRU) lives in the gateway alone.
A worker asks it for blocks to load (`MatchCall` -> `Lease`) and for slots to store into
(`PlanStoreCall` -> `StorePlan`), moves the bytes itself in the shared arena, then says so
(`ReleaseLease`, `CommitStore`). Messages on one connection arrive in order, so a commit is
applied before any later call of the same worker.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

# The cache index's answers to a worker's calls (IndexReply) are its own types, defined with it.
from cache.index import Lease, StorePlan
from cache.kv_codec import KVLayout

# ----- what a request asks for and what it gets ---------------------------------------------


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    grammar: str | None = None  # GBNF the output must follow (structured outputs, calls)
    # Lazy: the grammar applies once the output matches one of these (from its first group).
    grammar_triggers: tuple[str, ...] = ()
    # A test-only hook (tests/replay_gateway.py): these tokens are the output, then its end,
    # whatever the model's logits say; the model still computes every one of them.
    script: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampler: SamplerSettings = SamplerSettings()
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # The tenant's cache namespace, set by the server from the API key, never by the client:
    # its prefixes (in the pool and in live sequences) are shared with no other namespace.
    namespace: str = ""
    logprobs: int | None = None  # None: none; k: each chosen token's and the k likeliest
    # Special tokens whose text the output keeps: a chat format's markers (harmony's
    # <|channel|>, Mistral's [TOOL_CALLS]), as llama-server keeps its "preserved tokens".
    shown_tokens: frozenset[int] = frozenset()
    prediction: tuple[int, ...] = ()  # the output the client expects, drafted from
    history: tuple[int, ...] = ()  # what the cache holds after the prompt, drafted from


class EngineUnavailable(RuntimeError):
    """No engine can take the request: stopping, dead, or none ready. An `Output` with
    `unavailable` set carries it across (a 503 to the client)."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Predicted Outputs, as OpenAI counts them: prediction tokens the output took, and
    # those it did not (drafted and rejected)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's distribution (before penalties,
    bias and temperature, as OpenAI and vLLM define it), with the likeliest alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Output:
    """One engine step's result for a request: new text, and on the last one why it ended."""

    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | None while generating
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    usage: Usage | None = None
    error: str | None = None
    unavailable: bool = False  # the engine stopped or died: a 503, not a 500
    # Refused at admission by an engine elsewhere (a Dynamo node at capacity): the 429 a
    # local engine's refusal is, when nothing was sent yet.
    refused: bool = False
    generated: tuple[int, ...] = ()  # on the last output: every generated token id
    token_ids: tuple[int, ...] = ()  # the generated tokens this output adds (Dynamo's stream)
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens this output's text came from
    n_generated: int = 0  # completion tokens so far: what an abandoned request has cost
    cached_tokens: int | None = None  # on the first output: prompt tokens a cache served

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class CacheStats:
    """A worker's side of the prefix cache: what it loaded and stored."""

    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens loaded from the pool instead of computed
    store_failures: int = 0  # stores that raised: the request ran on, uncached
    load_failures: int = 0  # loads llama.cpp refused (no free cells): the prompt was computed
    loads: int = 0
    load_seconds: float = 0.0  # assembling and loading matched blocks into sequences
    stores: int = 0
    store_seconds: float = 0.0  # serialising sequences and cutting them into blocks


@dataclass(frozen=True)
class EngineSnapshot:
    """What an engine publishes after every step, for readers on other threads or processes."""

    running: int = 0
    waiting: int = 0
    cells_used: int = 0
    cells_total: int = 0
    preemptions: int = 0
    shared_tokens: int = 0  # prompt tokens taken from live sequences' cells
    computed_tokens: int = 0  # prompt tokens prefilled: neither shared nor loaded
    # Per draft source (engine/speculation.py): (source, tokens verified, tokens accepted)
    drafts: tuple[tuple[str, int, int], ...] = ()
    cache: CacheStats | None = None


# ----- gateway -> worker --------------------------------------------------------------------


@dataclass(frozen=True)
class Attach:
    arena_path: str | None  # None: no prefix cache
    fingerprint: str | None = None  # what the arena's header must say (see Ready)


@dataclass(frozen=True)
class Submit:
    request_id: int
    request: GenerationRequest
    pool_hint: int = 0  # prompt tokens the pool held when the request was routed


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class IndexReply:
    call_id: int
    result: Lease | StorePlan


# ----- worker -> gateway --------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBuffer:
    """Memory llama.cpp allocated for a worker, as it reports it when loading."""

    buffer: str  # a device's (Vulkan0, CUDA0), or host memory's (CPU, CPU_Mapped, CUDA_Host)
    kind: str  # model | KV | RS (a recurrent state) | compute | output
    nbytes: int


@dataclass(frozen=True)
class Ready:
    pid: int
    seq_len: int  # tokens one request may hold
    cells_total: int
    # None: this worker caches nothing. The gateway adds the model's fingerprint to it, hashed
    # once for every worker (the whole GGUF: a pass over the file per worker otherwise).
    layout: KVLayout | None
    memory: tuple[MemoryBuffer, ...] = ()


@dataclass(frozen=True)
class Outputs:
    """Every output of one engine step, in one message."""

    items: tuple[tuple[int, Output], ...]


@dataclass(frozen=True)
class Published:
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class MatchCall:
    call_id: int
    tokens: np.ndarray
    namespace: str


@dataclass(frozen=True)
class PlanStoreCall:
    call_id: int
    tokens: np.ndarray
    namespace: str
    final: bool  # the request's last store: count it if its blocks do not fit
    hold: bool  # keep the stored path referenced (a preempted request resumes from it)


@dataclass(frozen=True)
class ReleaseLease:
    lease_id: int


@dataclass(frozen=True)
class CommitStore:
    plan_id: int
    written: bool  # False: the worker could not write the blocks; drop the plan


# ----- the connection they travel on -------------------------------------------------------


@dataclass
class Channel:
    """One end of a worker's connection. More than one thread sends on each end (a worker's
    engine and main threads; the gateway's event loop and reader threads), so sends take a
    lock: interleaved writes would corrupt the stream. Only one thread receives."""

    conn: Connection
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)

    def recv(self):
        return self.conn.recv()
