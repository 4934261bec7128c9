"""Continuous batching over one llama.cpp context.

One engine thread owns the context. Each step it admits waiting requests into free sequence slots,
prefills prompts in chunks under a per-step token budget (so a long prompt never stalls running
decodes for seconds), decodes one token for every running sequence, all in a single llama_decode
call, and samples. Outputs cross to the asyncio side through `loop.call_soon_threadsafe`; the
asyncio side never waits on llama.cpp.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from cache.radix_tree import Match
from gateway.llama import Batch, Context, ContextShape, DecodeError, Model, Sampler, SamplerSettings
from gateway.prefix_cache import CacheConfig, PrefixCache
from gateway.textstream import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    parallel: int = 8  # sequences decoded together
    seq_len: int = 4096  # KV cells one sequence may hold: prompt + completion
    batch_tokens: int = 256  # tokens per llama_decode call: decodes first, prefill chunks after
    threads: int = 2
    cache: CacheConfig = CacheConfig()


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampler: SamplerSettings = SamplerSettings()
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @functools.cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids, biases), built once rather than at every step."""
        return (np.fromiter(self.logit_bias.keys(), dtype=np.int64),
                np.fromiter(self.logit_bias.values(), dtype=np.float32))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Output:
    """One engine step's result for a request: new text, and on the last one why it ended."""

    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | None while generating
    usage: Usage | None = None
    error: str | None = None


class GenerationHandle:
    """The asyncio side of one request: iterate `outputs()`, call `cancel()` to abandon it."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self.cancelled = False
        self.finished = False

    def deliver(self, output: Output) -> None:
        """Called from the engine thread."""
        # A closed loop (RuntimeError) means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)

    async def outputs(self) -> AsyncIterator[Output]:
        while not self.finished:
            output = await self._queue.get()
            self.finished = output.finish_reason is not None or output.error is not None
            yield output

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._engine.wake()


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one admitted or waiting request."""

    request: GenerationRequest
    handle: GenerationHandle
    slot: int = -1
    n_past: int = 0  # tokens already in the KV cache
    cached: int = 0  # prompt tokens loaded from the prefix cache instead of computed
    generated: list[int] = field(default_factory=list)  # the last one is not decoded yet
    sampler: Sampler | None = None
    text: TextStream | None = None
    holds: list[Match] = field(default_factory=list)  # cached blocks this sequence keeps alive

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.request.prompt_tokens)

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV the sequence holds."""
        return (self.request.prompt_tokens + self.generated)[: self.n_past]


class Engine:
    def __init__(self, model: Model, config: EngineConfig) -> None:
        if config.batch_tokens < config.parallel:
            raise ValueError("batch_tokens must be at least parallel: every running sequence "
                             "decodes one token per step")
        self.model = model
        self.config = config
        self.ctx = Context(model, ContextShape(
            n_ctx=config.parallel * config.seq_len,
            n_seq_max=config.parallel,
            n_batch=config.batch_tokens,
            n_threads=config.threads,
        ))
        self._batch = Batch(config.batch_tokens)
        self.cache = PrefixCache.for_context(model, self.ctx, config.cache)
        self._inbox: queue.SimpleQueue[_Sequence | None] = queue.SimpleQueue()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._free_slots = list(range(config.parallel))
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ----- asyncio side -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        handle = GenerationHandle(self, asyncio.get_running_loop())
        self._inbox.put(_Sequence(request, handle))
        return handle

    def wake(self) -> None:
        self._inbox.put(None)

    def stop(self) -> None:
        self._stopping = True
        self.wake()
        self._thread.join(timeout=30)
        if self.cache:
            self.cache.close()
        self._batch.close()
        self.ctx.close()

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    # ----- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception:  # keep serving: fail what was in flight, not the process
                log.exception("engine step failed")
                for seq in list(self._running):
                    self._finish(seq, Output(error="internal engine error"))
        for seq in list(self._running) + list(self._waiting):
            self._finish(seq, Output(error="server shutting down"))

    def _step(self) -> None:
        self._take_inbox(block=not self._running and not self._waiting)
        self._drop_cancelled()
        self._admit()
        if not self._running:
            return
        sampled = self._fill_batch()
        try:
            self.ctx.decode(self._batch)
        except DecodeError as exc:
            log.error("%s; failing the %d sequences in the batch", exc, len(self._running))
            for seq in list(self._running):
                self._finish(seq, Output(error=str(exc)))
            return
        for seq, batch_index in sampled:
            self._sample(seq, batch_index)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.handle.cancelled]:
            self._release(seq)
        self._waiting = deque(s for s in self._waiting if not s.handle.cancelled)

    def _admit(self) -> None:
        deferred = deque()
        while self._waiting and self._free_slots:
            seq = self._waiting.popleft()
            if self._prefix_in_flight(seq):
                deferred.append(seq)
                continue
            try:
                seq.sampler = Sampler(seq.request.sampler, self.model.n_vocab,
                                      penalty_window=self.config.seq_len)
            except Exception as exc:  # a request llama.cpp rejects must not take others down
                log.exception("could not set up sampling")
                self._finish(seq, Output(error=f"could not set up sampling: {exc}"))
                continue
            seq.slot = self._free_slots.pop()
            seq.text = TextStream(seq.request.stop)
            self._running.append(seq)
            if self.cache:
                self._load_cached_prefix(seq)
        self._waiting.extendleft(reversed(deferred))

    def _load_cached_prefix(self, seq: _Sequence) -> None:
        try:
            match = self.cache.load(seq.request.prompt_tokens, seq.slot)
        except Exception:  # the cache is an optimisation: compute the prompt instead
            log.exception("loading cached blocks failed; computing the prompt")
            self.ctx.forget(seq.slot)
            return
        seq.holds.append(match)
        seq.n_past = seq.cached = match.n_tokens

    def _prefix_in_flight(self, seq: _Sequence) -> bool:
        """True while a running request is still computing at least a block more of this
        request's prompt than the cache holds: waiting for it beats computing it twice."""
        if not self.cache:
            return False
        prompt = seq.request.prompt_tokens
        shared = max((_common_prefix(prompt, other.request.prompt_tokens)
                      for other in self._running if other.prefilling), default=0)
        if shared < self.cache.pool.block_size:
            return False
        return shared - self.cache.cached_length(prompt[:shared]) >= self.cache.pool.block_size

    def _fill_batch(self) -> list[tuple[_Sequence, int]]:
        """Decode tokens first (one per generating sequence), then prompt chunks in arrival order
        while the budget lasts. Returns the sequences to sample with their logits' batch index."""
        entries = [(seq, seq.generated[-1:], True) for seq in self._running if not seq.prefilling]
        budget = self._batch.capacity - len(entries)
        for seq in self._running:
            if budget == 0:
                break
            if seq.prefilling:
                prompt = seq.request.prompt_tokens
                chunk = prompt[seq.n_past: seq.n_past + budget]
                entries.append((seq, chunk, seq.n_past + len(chunk) == len(prompt)))
                budget -= len(chunk)
        # In sequence-id order: llama.cpp splits a batch whose sequences are out of order into
        # many small compute passes (8 decodes took twice as long in reverse order).
        entries.sort(key=lambda entry: entry[0].slot)
        self._batch.clear()
        sampled = []
        for seq, tokens, wants_logits in entries:
            index = self._batch.add(tokens, seq.n_past, seq.slot, wants_logits)
            seq.n_past += len(tokens)
            if wants_logits:
                sampled.append((seq, index))
        return sampled

    def _sample(self, seq: _Sequence, batch_index: int) -> None:
        request = seq.request
        suppress_eog = request.ignore_eos or len(seq.generated) < request.min_tokens
        if suppress_eog or request.logit_bias:
            logits = self.ctx.logits(batch_index)
            if request.logit_bias:
                ids, biases = request.bias_arrays
                logits[ids] += biases
            if suppress_eog:
                logits[self.model.eog_tokens] = -np.inf
        token = seq.sampler.sample(self.ctx, batch_index)
        prompt_done = not seq.generated
        if self.model.is_eog(token):
            self._finish(seq, Output(text=seq.text.flush(), finish_reason="stop"))
            return
        seq.generated.append(token)
        text = seq.text.push(self.model.token_piece(token))
        if seq.text.stopped:
            self._finish(seq, Output(text=text, finish_reason="stop"))
        elif len(seq.generated) >= request.max_tokens:
            self._finish(seq, Output(text=text + seq.text.flush(), finish_reason="length"))
        else:
            if text:
                seq.handle.deliver(Output(text=text))
            if self.cache and prompt_done:  # after the first token is out: others reuse it now
                seq.holds.append(self.cache.store(seq.kv_tokens(), seq.slot))

    def _finish(self, seq: _Sequence, output: Output) -> None:
        if self.cache and output.error is None and seq in self._running:
            # Prompt and answer, so that the next turn of a chat finds its history cached. The
            # holds go first so that the partial tail block stored after prefill, now superseded
            # by a longer copy, can be dropped.
            self._drop_holds(seq)
            seq.holds.append(self.cache.store(seq.kv_tokens(), seq.slot))
        usage = Usage(prompt_tokens=len(seq.request.prompt_tokens),
                      completion_tokens=len(seq.generated), cached_tokens=seq.cached)
        self._release(seq)  # before the client hears the end, so nothing of it is left then
        seq.handle.deliver(Output(output.text, output.finish_reason, usage, output.error))

    def _release(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
            self.ctx.forget(seq.slot)
            self._free_slots.append(seq.slot)
            seq.sampler.close()
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._drop_holds(seq)

    def _drop_holds(self, seq: _Sequence) -> None:
        for match in seq.holds:
            self.cache.release(match)
        seq.holds.clear()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
