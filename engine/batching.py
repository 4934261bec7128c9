"""Continuous batching over one llama.cpp context.

One engine thread owns the context. Each step it admits waiting requests into free sequences,
decodes one token for every generating sequence and prompt chunks after them, all in a single
llama_decode call, and samples. Outputs go to each request's sink (in a worker process, an
outbox sent once per step); nothing outside the engine thread ever waits on llama.cpp.

Two modes (see docs/architecture.md, "Engine modes"):
- default: F16 KV, one unified pool of cells for all sequences. A request whose prefix a live
  sequence holds shares those cells (`llama_memory_seq_cp`, no copy); the block pool supplies only
  what no live sequence holds. When the cells run out, the newest request is preempted: its blocks
  go to the pool, its cells are freed, and it resumes from the pool later.
- deterministic: Q8_0 KV in one stream per sequence, so a request's greedy output does not depend
  on what runs beside it or on the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cache.arena import BlockArena
from cache.tokens import COMPUTED_TAIL, common_prefix, reusable_prompt
from engine.config import EngineConfig
from engine.kv_cells import CellLedger
from engine.llama import (
    Batch,
    Candidates,
    Context,
    DecodeError,
    KVCacheFull,
    Model,
    Sampler,
)
from engine.messages import (
    EngineSnapshot,
    EngineUnavailable,
    GenerationRequest,
    Output,
    TokenLogprob,
    Usage,
)
from engine.prefill_context import SEQ as PREFILL_SEQ
from engine.prefill_context import PrefillContext
from engine.prefix_cache import BlockIndex, PrefixCache, cacheable_layout
from engine.scheduler import Scheduler
from engine.speculation import (
    MAX_DRAFT,
    MAX_DRAFTING_STREAMS,
    SOURCES,
    Drafter,
    PredictedOutput,
    SuffixIndex,
    TenantAnswers,
    draft_row_worth,
)
from engine.textstream import TextStream

log = logging.getLogger(__name__)

# llama.cpp's CPU flash attention over F16 KV computes a call of at least this many rows in
# tiles of 64 rows by 64 cells, and skips a tile only where every row masks every cell. A tile
# holding several sequences' decode rows skips none, so beside a prompt chunk each decode row
# pays for attention over every sequence's cells: 7 decodes and 64 prompt tokens took 355 ms in
# one call, 297 ms as two (loadtest.step_cost; a call under 64 rows skips cell by cell).
FA_TILE_ROWS = 64


class OutputSink(Protocol):
    """Where a request's outputs go: an asyncio queue in-process, a worker's outbox otherwise.
    `deliver` is called on the engine thread; `cancelled` is set by whoever abandons it."""

    cancelled: bool

    def deliver(self, output: Output) -> None: ...


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one request, waiting, running or preempted."""

    request: GenerationRequest
    handle: OutputSink
    prompt: np.ndarray  # the prompt tokens, for vectorised prefix comparisons
    tokens: list[int]  # prompt, then generated; the last one's KV is computed at the next step
    pool_hint: int = 0  # prompt tokens the pool held when the request arrived
    slot: int = -1
    admitted: int = 0  # admission order (0: never admitted): preemption takes the newest
    n_past: int = 0  # positions whose KV the sequence holds
    cached: int = 0  # prompt tokens taken from the pool or a live sequence, not computed
    sampler: Sampler | None = None
    text: TextStream | None = None
    holds: list[int] = field(default_factory=list)  # leases kept for resuming after preemption
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet delivered
    unsent: str = ""  # text of this step's tokens, delivered once the step is done with it
    n_sent: int = 0  # generated tokens already delivered (as ids, beside their text)
    drafter: Drafter = field(default_factory=Drafter)
    draft: list[int] = field(default_factory=list)  # tokens this step verifies after its last
    predicted: list[int] = field(default_factory=lambda: [0, 0])  # accepted, rejected
    apart: bool = False  # its prompt is being computed in the prefill context, not the pool

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt_tokens)

    @property
    def pending(self) -> int:
        """Known tokens whose KV is not computed yet (1 for a generating sequence)."""
        return len(self.tokens) - self.n_past

    def kv_tokens(self) -> np.ndarray:
        """The tokens whose KV the sequence holds."""
        if self.n_past <= len(self.prompt):
            return self.prompt[: self.n_past]
        return np.asarray(self.tokens[: self.n_past], dtype=np.int32)


class Engine:
    """`on_publish` receives the snapshot after every step, on the engine thread."""

    def __init__(self, model: Model, config: EngineConfig,
                 on_publish: Callable[[EngineSnapshot], None] | None = None) -> None:
        if config.batch_tokens < config.parallel:
            raise ValueError("batch_tokens must be at least parallel: every running sequence "
                             "decodes one token per step")
        self.model = model
        self.config = config
        self.unified = not config.deterministic
        # Drafts need a KV whose last positions can be dropped: not a recurrent state, nor a
        # window cache, which forgets the positions the draft's end has passed.
        on_device = model.placement is not None and model.placement.on_device
        wanted = config.speculation if config.speculation is not None else not on_device
        if config.speculation is None and on_device:
            log.info("speculation off: on a GPU device a step verifying drafts rounds unlike "
                     "single-token steps, so greedy output could differ (--speculation on "
                     "keeps it)")
        self.speculation = wanted and not model.has_recurrent_state and \
            (model.n_swa == 0 or config.swa_full)
        # A step asks for a row of logits per sequence, and per drafted token: the compute
        # buffers need no more (by default llama.cpp reserves rows of logits for the whole
        # batch, ~100 MiB for a 49k vocabulary and 512 tokens, on the device with its layers),
        # and llama.cpp wants at least a row per sequence id.
        shape = config.context_shape()
        shape = dataclasses.replace(shape, n_outputs=max(shape.n_seq_max, min(
            config.batch_tokens, config.parallel * (1 + MAX_DRAFT if self.speculation else 1))))
        # Tokens one request may hold: the whole pool when it is shared, else one stream.
        per_sequence = shape.n_ctx if self.unified else shape.n_ctx // shape.n_seq_max
        self.seq_len = per_sequence if config.beyond_training else \
            min(per_sequence, model.n_ctx_train)
        if self.seq_len > model.n_ctx_train:
            log.warning("requests of up to %d tokens, past the model's training context of %d: "
                        "quality may drop beyond it", self.seq_len, model.n_ctx_train)
        self.ctx = Context(model, shape)
        if per_sequence > model.n_ctx_train >= self.seq_len:
            log.info("llama.cpp's n_ctx_seq (%d) > n_ctx_train (%d) is no overflow here: "
                     "n_ctx_seq is the KV cells one sequence may reach (with unified KV, the "
                     "whole pool all sequences share), and a request is capped at %d tokens, "
                     "the model's training context (an explicit --ctx-size lifts the cap)",
                     per_sequence, model.n_ctx_train, self.seq_len)
        self.cells = CellLedger(shape.n_ctx)
        self._batch = Batch(config.batch_tokens)
        self._tiles_mix_sequences = shape.flash_attn and shape.kv_type == "f16"
        self.scheduler = Scheduler.for_config(config, prompts_apart=self._tiles_mix_sequences)
        # A pool sequence's share of the cells: the longest prompt computed apart from them.
        self.prefill = PrefillContext(model, shape, min(self.seq_len, shape.n_ctx //
                                                        config.parallel)) \
            if config.prefill_context and self.unified and self._tiles_mix_sequences and \
            not model.has_recurrent_state and model.n_swa == 0 else None
        self._candidates = Candidates(model.n_vocab)
        # What a block of this context's KV looks like; None: nothing is cached.
        self.kv_layout = cacheable_layout(model, self.ctx, config.cache)
        self.cache: PrefixCache | None = None
        self._on_publish = on_publish
        self._inbox: queue.SimpleQueue[_Sequence | None] = queue.SimpleQueue()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._free_slots = list(range(config.parallel - 1, -1, -1))
        self._admissions = itertools.count(1)
        self._paused_by_preemption = False  # until a running request releases its cells
        self._preemptions = 0
        self._shared_tokens = 0
        self._computed_tokens = 0
        self._drafts = {source: [0, 0] for source in SOURCES}  # drafted, accepted
        self._answers = SuffixIndex()  # the answers given lately, drafted from
        self._stopping = False
        self._lock = threading.Lock()  # orders submit() against the engine stopping or dying
        self.failure: str | None = None  # why the engine thread died, if it did
        self.snapshot = EngineSnapshot(cells_total=shape.n_ctx)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ----- other threads ----------------------------------------------------------------------

    def use_cache(self, arena: BlockArena, index: BlockIndex) -> None:
        """Before start(): cache blocks in `arena`, at the slots `index` assigns."""
        if self.kv_layout is not None:
            self.cache = PrefixCache(self.ctx, self.kv_layout, arena, index,
                                     scratch_seq=self.config.parallel if self.unified else None)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: OutputSink, pool_hint: int = 0) -> None:
        seq = _Sequence(request, sink, np.asarray(request.prompt_tokens, dtype=np.int32),
                        list(request.prompt_tokens), pool_hint=pool_hint)
        for source, expected in (("prediction", request.prediction),
                                 ("history", request.history)):
            if expected:
                seq.drafter.expected[source] = PredictedOutput(list(expected))
        seq.drafter.lookups["suffix"] = TenantAnswers(self._answers, request.namespace)
        with self._lock:
            if self.failure or self._stopping:
                raise EngineUnavailable(self.failure or "the server is shutting down")
            self._inbox.put(seq)

    def wake(self) -> None:
        self._inbox.put(None)

    def stop(self, timeout: float = 60) -> None:
        with self._lock:
            self._stopping = True
        self.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():  # still inside llama.cpp: freeing its context would crash
            log.error("the engine thread did not stop within %.0f s; leaving its context", timeout)
            return
        self._batch.close()
        if self.prefill:
            self.prefill.close()
        self.ctx.close()

    @property
    def alive(self) -> bool:
        return self.failure is None and not self._stopping

    # ----- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._step()
                except Exception:  # keep serving: fail what was in flight, not the process
                    log.exception("engine step failed")
                    for seq in list(self._running):
                        self._finish(seq, Output(error="internal engine error"))
                self._publish()
            reason = "the server is shutting down"
        except BaseException as exc:  # the thread dies: say so, and answer everyone
            log.exception("the engine thread died")
            reason = f"the engine stopped: {exc!r}"
            with self._lock:
                self.failure = reason
        with self._lock:  # nothing enters the inbox after this
            self._take_inbox(block=False)
        for seq in list(self._running) + list(self._waiting):
            with contextlib.suppress(Exception):
                self._release(seq)
            seq.handle.deliver(Output(error=reason, unavailable=True))
        self._running.clear()
        self._waiting.clear()
        self._publish()

    def _step(self) -> None:
        self._take_inbox(block=not self._running and not self._waiting)
        self._drop_cancelled()
        self._admit()
        if not self._running:
            return
        while True:
            plan = self._plan_batch()
            if not plan:  # prompt chunks found no free cells
                self._preempt_newest()
                continue
            try:
                self._compute(plan)
                return
            except KVCacheFull:
                self._preempt_newest()
            except DecodeError as exc:
                log.error("%s; failing the %d sequences in the batch", exc, len(self._running))
                for seq in list(self._running):
                    self._finish(seq, Output(error=str(exc)))
                return

    def _compute(self, plan: list[tuple[_Sequence, list[int]]]) -> None:
        """Computes the planned rows in one llama_decode call, or in two where decode rows
        would share flash-attention tiles with prompt rows: the decodes, then the prompts; and
        the chunk of the prompt computed apart in a call of its own, last. Raises KVCacheFull
        only when nothing was computed."""
        apart = [entry for entry in plan if entry[0].apart]
        pooled = [entry for entry in plan if not entry[0].apart]
        calls = [(self.ctx, pooled)] if pooled else []
        decodes = [entry for entry in pooled if entry[0].pending == 1]
        if self._tiles_mix_sequences and decodes and len(decodes) < len(pooled) and \
                sum(len(tokens) for _, tokens in pooled) >= FA_TILE_ROWS:
            calls = [(self.ctx, decodes),
                     (self.ctx, [entry for entry in pooled if entry[0].pending > 1])]
        if apart:
            calls.append((self.prefill.ctx, apart))
        for i, (ctx, call) in enumerate(calls):
            entries = self._fill_batch(call)
            started = time.perf_counter()
            try:
                ctx.decode(self._batch)
            except KVCacheFull:
                if i == 0:
                    raise
                self._preempt_newest()  # the decodes are done: the prompts wait a step
                return
            self._take_outputs(entries, started, ctx)

    def _take_outputs(self, entries: list[tuple[_Sequence, int, int | None]],
                      started: float, ctx: Context) -> None:
        """Advances the sequences past the call's rows and samples where it gave logits."""
        # Drafts count with the prompt tokens: rows beside the decodes, costing about as much.
        n_decode = sum(1 for seq, _, _ in entries if seq.pending == 1)
        for seq, n_tokens, batch_index in entries:
            if seq.draft:
                self._verify(seq, batch_index)
                continue
            if seq.n_generated == 0:
                self._computed_tokens += n_tokens
            seq.n_past += n_tokens
            if seq.apart:
                if seq.pending or not self._move_into_pool(seq):
                    continue
            else:
                self.cells.add(seq.slot, n_tokens)
            if self.cache and self.cache.stores_eagerly:
                self._store_completed_blocks(seq, n_tokens)
            if batch_index is not None:
                self._sample(seq, batch_index, ctx)
        # The call as the running streams wait for it: computing, sampling and storing.
        self.scheduler.fit.observe(n_decode, sum(n for _, n, _ in entries) - n_decode,
                                   time.perf_counter() - started)

    def _move_into_pool(self, seq: _Sequence) -> bool:
        """Moves a prompt computed apart into the pool. Where the pool has no room for it, the
        prompt is computed again in the pool (False)."""
        seq.apart = False
        try:
            self.prefill.move_into(self.ctx, seq.slot)
        except DecodeError:
            log.warning("no room in the pool for a prompt of %d tokens computed apart; "
                        "computing it there", seq.n_past)
            seq.n_past = 0
            return False
        self.cells.add(seq.slot, seq.n_past)
        return True

    def _store_completed_blocks(self, seq: _Sequence, n_tokens: int) -> None:
        """Stores the blocks the step completed, while all their KV is still in the context."""
        bs = self.cache.block_size
        if seq.n_past // bs > (seq.n_past - n_tokens) // bs:
            self.cache.store(seq.kv_tokens()[: seq.n_past // bs * bs], seq.request.namespace,
                             seq.slot, final=False)

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
        for seq in [s for s in self._running + list(self._waiting) if s.handle.cancelled]:
            self._release(seq)

    # ----- admission --------------------------------------------------------------------------

    def _admit(self) -> None:
        """Admits waiting requests in arrival order while sequences and cells last. A request
        whose prefix a running request is still computing waits for those cells instead of
        computing them twice; it does not hold back the requests behind it."""
        if self._paused_by_preemption:
            return
        for seq in list(self._waiting):
            if not self._free_slots:
                return
            target = self._reusable(seq)
            donor, live = self._live_prefix(target, seq.request.namespace)
            if self._prefix_in_flight(target, seq.request.namespace, live, seq.pool_hint):
                continue
            if self.unified and self._running and not self._cells_suffice(seq, live):
                return
            self._waiting.remove(seq)
            try:
                self._start(seq, donor, live)
            except Exception as exc:  # one request llama.cpp rejects must not take others down
                log.exception("could not admit a request")
                self._finish(seq, Output(error=f"could not start generation: {exc}"))

    def _reusable(self, seq: _Sequence) -> np.ndarray:
        """The tokens whose KV may come from elsewhere: for a new prompt, all but its computed
        tail (cache.tokens); a resumed request recomputes just its last token, as its decode
        did."""
        if seq.n_generated == 0:
            return reusable_prompt(seq.prompt)
        return np.asarray(seq.tokens[:-1], dtype=np.int32)

    def _cells_suffice(self, seq: _Sequence, live: int) -> bool:
        # Room for its prompt beside one more token for every running sequence.
        return len(seq.tokens) - live + len(self._running) <= self.cells.free

    def _start(self, seq: _Sequence, donor: _Sequence | None, live: int) -> None:
        if seq.sampler is None:
            request = seq.request
            seq.sampler = Sampler(request.sampler, self.model, penalty_window=self.seq_len,
                                  logit_bias=request.logit_bias,
                                  ban_eog=request.ignore_eos or request.min_tokens > 0)
            seq.text = TextStream(seq.request.stop)
        # Only what came from elsewhere before the request first computed counts as cached or
        # shared: a request resumed after preemption reloads what it computed itself.
        first = seq.admitted == 0
        seq.slot = self._free_slots.pop()
        seq.admitted = next(self._admissions)
        self._running.append(seq)
        if self.cache:
            self._load_cached(seq, donor, live, first)
        if first:
            seq.cached = seq.n_past
        # A prompt with nothing to share is computed apart from the other sequences' cells;
        # one too short for a call of its own stays beside the decodes.
        if self.prefill and first and seq.n_past == 0 and len(seq.tokens) >= FA_TILE_ROWS \
                and self.prefill.takes(len(seq.tokens)):
            seq.apart = self.prefill.busy = True

    def _load_cached(self, seq: _Sequence, donor: _Sequence | None, live: int,
                     first: bool) -> None:
        try:
            shared, held = self.cache.load(self._reusable(seq), seq.request.namespace,
                                           seq.slot, donor.slot if donor else None, live)
        finally:
            self._drop_holds(seq)
        if shared:
            self.cells.share(donor.slot, seq.slot, shared)
            self._shared_tokens += shared if first else 0
        self.cells.add(seq.slot, held - shared)
        if first:
            self.cache.stats.queried_tokens += len(seq.prompt)
            self.cache.stats.hit_tokens += held - shared
        seq.n_past = held

    def _live_prefix(self, tokens: np.ndarray, namespace: str) -> tuple[_Sequence | None, int]:
        """The running sequence of the same namespace holding the longest computed prefix of
        `tokens` (another tenant's would answer faster: a timing side channel)."""
        best, best_len = None, 0
        if not self.unified or not self.cache or self.cache.keeps_states:
            return best, best_len  # streams share no cells; no cache, no reuse
        for other in self._running:
            if other.request.namespace != namespace or other.apart:  # its cells are elsewhere
                continue
            n = common_prefix(tokens, other.kv_tokens())
            if n > best_len:
                best, best_len = other, n
        return best, best_len

    def _prefix_in_flight(self, tokens: np.ndarray, namespace: str, live: int,
                          pool_hint: int) -> bool:
        """True while a running request is prefilling at least a block more of `tokens` than a
        live sequence or the pool (as it was when the request arrived: asking the index again
        for every waiting request at every step would cost a round trip each) can give."""
        if not self.cache:
            return False
        pending = max((common_prefix(tokens, other.prompt[:-1]) for other in self._running
                       if other.n_generated == 0 and other.pending > 1
                       and other.request.namespace == namespace), default=0)
        have = max(live, min(pool_hint, pending))
        # A block more to gain, or all of it: the same prompt (n choices, a retry) always waits.
        return pending - have >= self.cache.block_size or pending >= len(tokens) > have

    # ----- one step ---------------------------------------------------------------------------

    def _plan_batch(self) -> list[tuple[_Sequence, list[int]]]:
        """The step's rows: one token for every generating sequence (and its draft), then
        prompt chunks in arrival order while the token budget (engine/scheduler.py) and the
        free cells last. Several prompts share a step rather than each taking one of its own:
        the first still gets its first token soonest, a prompt row costs no more in a bigger call
        (a few percent less where the pool is fuller), and every step that computes prompt rows
        slows its decodes' call (loadtest.step_cost measures both)."""
        decoding = [seq for seq in self._running if seq.pending == 1 and not seq.apart]
        while self.unified and len(decoding) > self.cells.free and len(self._running) > 1:
            victim = self._preempt_newest()
            decoding = [seq for seq in decoding if seq is not victim]
        plan = self._decode_rows(decoding)
        n_rows = sum(len(tokens) for _, tokens in plan)
        prompting = len(plan) < len(self._running)  # some sequences have prompt tokens left
        budget = self.scheduler.prompt_budget(n_rows, self._batch.capacity) if prompting \
            else 0
        if self.unified:
            budget = min(budget, self.cells.free - n_rows)
        for seq in self._running:
            if budget <= 0:
                break
            if seq.pending > 1 or seq.apart:
                chunk = seq.tokens[seq.n_past: self._chunk_end(seq, budget)]
                plan.append((seq, chunk))
                budget -= len(chunk)
        return plan

    def _fill_batch(self, plan: list[tuple[_Sequence, list[int]]]
                    ) -> list[tuple[_Sequence, int, int | None]]:
        """Puts the planned rows in the batch. Returns (sequence, tokens added, batch index of
        its logits or None)."""
        # In sequence-id order: llama.cpp splits a batch whose sequences are out of order into
        # many small compute passes (8 decodes took twice as long in reverse order).
        plan = sorted(plan, key=lambda entry: entry[0].slot)
        self._batch.clear()
        entries = []
        for seq, tokens in plan:
            # The draft, past the known tokens, is verified: a row of logits for each position.
            n_logits = len(seq.draft) + 1 if seq.draft else \
                int(seq.n_past + len(tokens) == len(seq.tokens))
            index = self._batch.add(tokens, seq.n_past, PREFILL_SEQ if seq.apart else seq.slot,
                                    n_logits)
            entries.append((seq, len(tokens), index if n_logits else None))
        return entries

    def _decode_rows(self, decoding: list[_Sequence]) -> list[tuple[_Sequence, list[int]]]:
        """Each decoding sequence's last token, and when speculating its draft after it, within
        what the batch and the free cells leave beside the other sequences' tokens."""
        room = self._batch.capacity - len(decoding)
        if self.unified:
            room = min(room, self.cells.free - len(decoding))
        crowded = len(decoding) > MAX_DRAFTING_STREAMS
        drafting = self.speculation and (
            not crowded or any(seq.drafter.expected for seq in decoding))
        worth = draft_row_worth(self.scheduler.fit.cost, len(decoding), 0) if drafting else 1.0
        rows = []
        for seq in decoding:
            # A replayed completion (tests) takes its tokens from a script, not the model.
            seq.draft = self._draft(seq, worth, room, expected_only=crowded) \
                if drafting and not seq.sampler.scripted else []
            room -= len(seq.draft)
            rows.append((seq, seq.tokens[-1:] + seq.draft))
        return rows

    def _draft(self, seq: _Sequence, worth: float, room: int, expected_only: bool
               ) -> list[int]:
        """The tokens the sequence's draft sources suggest will follow, as many as are likely
        enough to be accepted to be `worth` their rows (engine/speculation.py)."""
        limit = min(room, MAX_DRAFT, seq.request.max_tokens - seq.n_generated - 1,
                    self.seq_len - len(seq.tokens))
        return seq.drafter.draft(seq.tokens, seq.n_generated, worth, limit, expected_only)

    def _chunk_end(self, seq: _Sequence, budget: int) -> int:
        """Where the sequence's next prompt chunk ends. A recurrent model's state can be kept
        only where a step ends, so its chunks end at block boundaries, and one at the last
        boundary a repeat of the prompt can resume from (before its computed tail)."""
        end = min(seq.n_past + budget, len(seq.tokens))
        if self.cache and self.cache.keeps_states:
            bs = self.cache.block_size
            last = end if end < len(seq.tokens) else end - COMPUTED_TAIL
            boundary = last // bs * bs
            if boundary > seq.n_past:
                return boundary
        return end

    def _preempt_newest(self) -> _Sequence:
        """Pauses the most recently admitted request: its KV goes to the pool (held, so that it
        survives until it resumes), its cells are freed, and it waits at the head of the queue.
        No more requests are admitted until a running one releases cells."""
        if len(self._running) < 2:
            raise RuntimeError("one request needs more KV cells than the context has")
        victim = max(self._running, key=lambda seq: seq.admitted)
        log.info("no free KV cells: preempting a request after %d tokens", victim.n_past)
        if self.cache and victim.n_past and not victim.apart:
            held = self.cache.store(victim.kv_tokens(), victim.request.namespace, victim.slot,
                                    final=False, hold=True)
            if held is not None:
                victim.holds.append(held)
        self._vacate(victim)
        victim.n_past = 0
        self._waiting.appendleft(victim)
        self._paused_by_preemption = True
        self._preemptions += 1
        return victim

    def _sample(self, seq: _Sequence, batch_index: int, ctx: Context) -> None:
        """Samples from the logits `ctx`'s last call left at `batch_index`."""
        prompt_done = seq.n_generated == 0
        if not self._add_token(seq, self._pick(seq, batch_index, 0, ctx), batch_index, ctx):
            return
        self._deliver_progress(seq, first=prompt_done)
        if self.cache and prompt_done and not self.unified:
            # Without shared cells, a request arriving meanwhile takes the prompt from the
            # pool: store it as soon as the first token is out.
            self.cache.store(seq.kv_tokens(), seq.request.namespace, seq.slot, final=False)

    def _verify(self, seq: _Sequence, batch_index: int) -> None:
        """The sequence's last token and its draft after it were computed, each with logits:
        picks a token at every position in turn while the picks equal the draft. The pick
        that differs (or follows the whole draft) is the step's last token; the cells of the
        draft after it are dropped."""
        draft, seq.draft = seq.draft, []
        picks: list[int] = []
        for i in range(len(draft) + 1):
            picks.append(self._pick(seq, batch_index + i, i, self.ctx))
            if i == len(draft) or picks[-1] != draft[i] or self.model.is_eog(picks[-1]):
                break
        accepted = len(picks) - 1
        seq.drafter.record(len(draft), accepted)
        counts = self._drafts[seq.drafter.source]
        counts[0] += len(draft)
        counts[1] += accepted
        if seq.drafter.source == "prediction":
            seq.predicted[0] += accepted
            seq.predicted[1] += len(draft) - accepted
        start = seq.n_past
        self.ctx.cut(seq.slot, start + 1 + accepted)
        self.cells.add(seq.slot, 1 + accepted)
        for i, token in enumerate(picks):
            seq.n_past = start + 1 + i  # the tokens before this pick, as a step apiece would
            if not self._add_token(seq, token, batch_index + i, self.ctx):
                return
        if self.cache and self.cache.stores_eagerly:
            self._store_completed_blocks(seq, 1 + accepted)
        self._deliver_progress(seq, first=False)

    def _pick(self, seq: _Sequence, batch_index: int, ahead: int, ctx: Context) -> int:
        """The sampler's token at a batch position, `ahead` tokens past the sequence's."""
        request = seq.request
        may_end = not request.ignore_eos and seq.n_generated + ahead >= request.min_tokens
        return seq.sampler.sample(ctx, batch_index, self._candidates, allow_eog=may_end)

    def _add_token(self, seq: _Sequence, token: int, batch_index: int, ctx: Context) -> bool:
        """Adds a picked token to the sequence; False when it ended the request."""
        request = seq.request
        if self.model.is_eog(token):
            self._finish(seq, Output(text=seq.text.flush(), finish_reason="stop"))
            return False
        seq.tokens.append(token)
        if request.logprobs is not None:  # sampling left the logits as the model gave them
            seq.logprobs.append(_token_logprob(ctx.logits(batch_index), token,
                                               request.logprobs))
        seq.unsent += seq.text.push(self.model.token_piece(token, token in request.shown_tokens))
        if seq.text.stopped:
            self._finish(seq, Output(finish_reason="stop", stop_sequence=seq.text.stop_string))
        elif seq.n_generated >= request.max_tokens:
            self._finish(seq, Output(text=seq.text.flush(), finish_reason="length"))
        else:
            return True
        return False

    def _deliver_progress(self, seq: _Sequence, first: bool) -> None:
        """The step's text of a running request, in one output; the first also says how much
        of the prompt was cached."""
        if seq.unsent or first:
            seq.handle.deliver(Output(text=seq.unsent, token_ids=_unsent_tokens(seq),
                                      logprobs=_take(seq.logprobs),
                                      n_generated=seq.n_generated,
                                      cached_tokens=seq.cached if first else None))
            seq.unsent = ""

    def _finish(self, seq: _Sequence, output: Output) -> None:
        if self.cache and output.error is None and seq in self._running:
            # Prompt and answer, so that the next turn of a chat finds its history cached.
            self.cache.store(seq.kv_tokens(), seq.request.namespace, seq.slot, final=True)
        if output.error is None:  # the text its last step made before the end
            output = dataclasses.replace(output, text=seq.unsent + output.text)
            if self.speculation:
                self._answers.add(seq.request.namespace, seq.request.prompt_tokens,
                                  seq.tokens[len(seq.request.prompt_tokens):])
        seq.unsent = ""
        usage = Usage(prompt_tokens=len(seq.request.prompt_tokens),
                      completion_tokens=seq.n_generated, cached_tokens=seq.cached,
                      accepted_prediction_tokens=seq.predicted[0],
                      rejected_prediction_tokens=seq.predicted[1])
        self._release(seq)  # before the client hears the end, so nothing of it is left then
        seq.handle.deliver(dataclasses.replace(
            output, usage=usage, generated=tuple(seq.tokens[len(seq.request.prompt_tokens):]),
            token_ids=_unsent_tokens(seq), logprobs=_take(seq.logprobs)))

    def _release(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._vacate(seq)
            self._paused_by_preemption = False
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if seq.sampler is not None:
            seq.sampler.close()
        self._drop_holds(seq)

    def _vacate(self, seq: _Sequence) -> None:
        """Frees the sequence's slot and its hold on cells."""
        self._running.remove(seq)
        seq.draft = []
        if seq.apart:
            seq.apart = False
            self.prefill.release()
        self.ctx.forget(seq.slot)
        self.cells.forget(seq.slot)
        self._free_slots.append(seq.slot)
        if not self._running:
            # Idle: start the next request at cell 0, the layout a fresh context gives it.
            self.ctx.clear()

    def _drop_holds(self, seq: _Sequence) -> None:
        for lease_id in seq.holds:
            self.cache.release(lease_id)
        seq.holds.clear()

    def _publish(self) -> None:
        cache = self.cache
        self.snapshot = EngineSnapshot(
            running=len(self._running), waiting=len(self._waiting),
            cells_used=self.cells.used, cells_total=self.cells.n_cells,
            preemptions=self._preemptions, shared_tokens=self._shared_tokens,
            computed_tokens=self._computed_tokens,
            drafts=tuple((source, *counts) for source, counts in self._drafts.items()),
            cache=dataclasses.replace(cache.stats) if cache else None)
        if self._on_publish:
            self._on_publish(self.snapshot)


def _token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    shifted = logits.astype(np.float64) - logits.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    best = np.argpartition(-logprobs, top)[:top] if top else np.empty(0, np.int64)
    best = best[np.argsort(-logprobs[best])]
    return TokenLogprob(token, float(logprobs[token]),
                        tuple((int(t), float(logprobs[t])) for t in best))


def _take(pending: list[TokenLogprob]) -> tuple[TokenLogprob, ...]:
    taken = tuple(pending)
    pending.clear()
    return taken


def _unsent_tokens(seq: _Sequence) -> tuple[int, ...]:
    """The generated token ids not delivered yet, now delivered."""
    start = len(seq.request.prompt_tokens) + seq.n_sent
    new = tuple(seq.tokens[start:])
    seq.n_sent += len(new)
    return new
