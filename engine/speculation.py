"""Speculative decoding: tokens drafted from text already at hand, verified in the step's batch.

A generating sequence whose last tokens appeared before, in its prompt or its own output, may
well go on as it did then (code rewritten with a small change, a passage quoted, JSON copied).
Those following tokens are the draft: the step computes them after the sequence's last token,
each with its logits, and the sampler picks a token at every position in turn, exactly as it
would one step after another. While its pick equals the draft, the draft's KV is the KV of the
picked token and the next position's logits are valid; at the first difference the pick is the
step's last token and the rest of the draft is dropped. So the output is the one the model
gives without drafts (up to the rounding of a bigger batch), greedy or sampled alike, with the
same random draws in the same order.

A draft token costs a row of the step, which every running stream waits for, and pays only if
accepted. Its length follows the request's own acceptance and the step's cost, so that drafting
backs off by itself when many streams run or the drafts keep failing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from engine.scheduler import StepCost

# The n-grams a draft is looked up by, longest first: a longer match predicts better.
NGRAM_SIZES = (4, 3, 2)
MAX_DRAFT = 16  # tokens verified at once for one sequence
# Beyond this many streams decoding together a sequence drafts only from an expected output
# (a prediction, an earlier answer to its prompt), not from lookups: unique prompts at
# concurrency 4 measured 0.82x with lookups allowed (loadtest.speculation, 2026-12-04).
MAX_DRAFTING_STREAMS = 2
# The request's own text; the client's predicted output; an earlier answer to the same prompt;
# what most often followed in the answers given lately (SuffixIndex)
SOURCES = ("prompt", "prediction", "history", "suffix")
# The contexts answers are indexed by, longest first: the end of the prompt before an answer
# (the chat template's last tokens are every answer's, the user's words before them are not)
# and the answer's own last tokens.
SUFFIX_NGRAMS = (16, 8, 4)
SUFFIX_CAPACITY = 1 << 16  # answer tokens a worker keeps indexed, its tenants' together
# A token is drafted from the answers only while it followed its context in at least this
# share of them: where they disagree, the draft stops.
SUFFIX_MIN_SHARE = 0.5
# A verified row costs more than a prompt token: its logits over the vocabulary. SmolLM2 on 2
# cores: 5.9 ms a row (13.5 ms for one token, 19.4 for two), 4.4 ms a prompt token.
ROW_OVER_PROMPT_TOKEN = 1.35
FADE = 0.8  # the weight a verification's count keeps at each later one
PROBE_AFTER = 8  # steps without drafts before a one-token probe; doubled while probes fail
MAX_PROBE_AFTER = 256


@dataclass
class NgramIndex:
    """Where each n-gram of a token list (its corpus) occurs last, with tokens after it;
    indexed as the corpus grows, so a lookup costs a dictionary access whatever its length."""

    # n -> an n-gram -> where the tokens after its latest occurrence start
    _index: dict[int, dict[tuple[int, ...], int]] = field(
        default_factory=lambda: {n: {} for n in NGRAM_SIZES})
    _indexed: int = 0  # corpus tokens whose preceding n-grams are indexed

    def follow(self, context: list[int], corpus: list[int], limit: int
               ) -> tuple[int, list[int]]:
        """The length of the longest n-gram ending `context` found in `corpus`, and up to
        `limit` tokens that followed its latest occurrence; (0, []) when none occurred."""
        self._catch_up(corpus)
        for n in NGRAM_SIZES:
            start = self._index[n].get(tuple(context[-n:]))
            if start is not None:
                return n, corpus[start: start + limit]
        return 0, []

    def _catch_up(self, corpus: list[int]) -> None:
        # The n-gram ending just before position i is followed by the tokens from i on; the
        # last n-gram has nothing after it yet, so it is indexed once the next token comes.
        for i in range(max(self._indexed, 1), len(corpus)):
            for n in NGRAM_SIZES:
                if i >= n:
                    self._index[n][tuple(corpus[i - n: i])] = i
        self._indexed = len(corpus)


@dataclass
class PromptLookup:
    """Drafts for one sequence from its own tokens (prompt lookup decoding): what followed the
    latest earlier occurrence of its last n tokens, in its prompt or its output."""

    index: NgramIndex = field(default_factory=NgramIndex)

    def draft(self, tokens: list[int], limit: int) -> tuple[int, list[int]]:
        """The length of the n-gram matched, and the draft."""
        return self.index.follow(tokens, tokens, limit)


@dataclass
class PredictedOutput:
    """Drafts from the answer the client predicted (OpenAI's Predicted Outputs): while the
    output follows the prediction from its start, the rest of it; once they part, what
    follows the output's last tokens in the prediction (an edit rejoins the unchanged text)."""

    tokens: list[int]
    index: NgramIndex = field(default_factory=NgramIndex)

    def draft(self, tokens: list[int], n_generated: int, limit: int) -> list[int]:
        generated = tokens[len(tokens) - n_generated:]
        if generated == self.tokens[:n_generated]:
            return self.tokens[n_generated: n_generated + limit]
        return self.index.follow(tokens, self.tokens, limit)[1]


@dataclass
class SuffixIndex:
    """The answers a worker gave lately, each after the end of its prompt, indexed as suffix
    decoding's global tree is: for each context of SUFFIX_NGRAMS tokens, how often each token
    followed it. A draft is the likeliest continuation, token by token, while the answers
    agree on it. Each namespace (tenant) has its own counts, so that no draft, nor how fast it
    is accepted, shows one tenant another's text. The oldest answers are forgotten beyond
    SUFFIX_CAPACITY tokens, their counts taken back."""

    capacity: int = SUFFIX_CAPACITY
    # namespace -> a context (a tuple of any of the SUFFIX_NGRAMS lengths) -> next -> count
    _counts: dict[str, dict[tuple[int, ...], dict[int, int]]] = field(default_factory=dict)
    _answers: deque[tuple[str, list[int], int]] = field(default_factory=deque)  # +where it starts
    _size: int = 0  # answer tokens indexed

    def add(self, namespace: str, prompt: Sequence[int], answer: list[int]) -> None:
        if not answer:
            return
        context = list(prompt[-SUFFIX_NGRAMS[0]:])
        text = context + answer
        self._count(namespace, text, len(context), 1)
        self._answers.append((namespace, text, len(context)))
        self._size += len(answer)
        while self._size > self.capacity:
            old_namespace, old, start = self._answers.popleft()
            self._count(old_namespace, old, start, -1)
            self._size -= len(old) - start

    def _count(self, namespace: str, text: list[int], start: int, delta: int) -> None:
        counts = self._counts.setdefault(namespace, {})
        for i in range(start, len(text)):
            for n in SUFFIX_NGRAMS:
                if i < n:
                    continue
                context = tuple(text[i - n: i])
                following = counts.setdefault(context, {})
                following[text[i]] = following.get(text[i], 0) + delta
                if not following[text[i]]:
                    del following[text[i]]
                    if not following:
                        del counts[context]
        if not counts:
            del self._counts[namespace]

    def draft(self, namespace: str, tokens: list[int], limit: int) -> tuple[int, list[int]]:
        """The length of the longest context matched at the draft's start, and up to `limit`
        tokens that most often followed, each in at least SUFFIX_MIN_SHARE of the answers
        where its own context occurred."""
        counts = self._counts.get(namespace)
        if not counts:
            return 0, []
        context = tokens[-SUFFIX_NGRAMS[0]:]
        drafted: list[int] = []
        matched = 0
        while len(drafted) < limit:
            n, following = next(((n, counts[key]) for n in SUFFIX_NGRAMS if len(context) >= n
                                 and (key := tuple(context[-n:])) in counts), (0, None))
            if following is None:
                break
            token, count = max(following.items(), key=itemgetter(1))
            if count < SUFFIX_MIN_SHARE * sum(following.values()):
                break
            matched = matched or n
            drafted.append(token)
            context = context[1:] + [token]
        return matched, drafted


@dataclass(frozen=True)
class TenantAnswers:
    """One namespace's drafts from the worker's SuffixIndex."""

    index: SuffixIndex
    namespace: str

    def draft(self, tokens: list[int], limit: int) -> tuple[int, list[int]]:
        return self.index.draft(self.namespace, tokens, limit)


@dataclass
class Acceptance:
    """How often a request's draft tokens are accepted, once the one before was: a rate over
    its recent verifications (older ones fade), starting from a prior worth a few. When the
    rate says no draft is worth its rows, a one-token draft still probes now and then, less
    often the longer they fail, so that a request whose answer starts copying late (after a
    preamble) still gets drafts."""

    accepted: float = 1.0
    tried: float = 2.0
    idle: int = 0  # steps without a draft since the last one
    probe_after: int = PROBE_AFTER

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def record(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens of which the first `accepted` were accepted:
        each up to the first rejected one was a trial."""
        self.accepted = self.accepted * FADE + accepted
        self.tried = self.tried * FADE + min(accepted + 1, drafted)
        self.idle = 0
        self.probe_after = PROBE_AFTER if accepted else min(self.probe_after * 2, MAX_PROBE_AFTER)

    def length(self, worth: float, limit: int) -> int:
        """The longest draft whose last token is still likely enough to be accepted (the
        j-th with probability rate^j) to be `worth` its row; or a probe of one."""
        n, p = 0, self.rate
        while n < limit and p >= worth:
            n, p = n + 1, p * self.rate
        if n == 0 and limit > 0:
            self.idle += 1
            if self.idle >= self.probe_after:
                return 1
        return n


@dataclass
class Drafter:
    """One sequence's draft sources, each with its own acceptance; `source` names the one of
    the draft being verified. The client's prediction first, then an earlier answer to the
    same prompt; else the request's own text or the answers given lately, whichever matches
    the sequence's last tokens over more of them."""

    # Expected outputs by source: the client's prediction, an earlier answer (tried in turn)
    expected: dict[str, PredictedOutput] = field(default_factory=dict)
    # Lookups by source: the request's own text, and the tenant's answers given lately
    lookups: dict[str, PromptLookup | TenantAnswers] = field(
        default_factory=lambda: {"prompt": PromptLookup()})
    # A prediction is the client's word that the output will be this: trusted from the start;
    # an earlier answer to the same prompt, greedy, would be repeated exactly.
    acceptance: dict[str, Acceptance] = field(default_factory=lambda: {
        "prediction": Acceptance(accepted=9.0, tried=10.0),
        "history": Acceptance(accepted=8.0, tried=10.0), "prompt": Acceptance(),
        "suffix": Acceptance()})
    source: str = "prompt"

    def draft(self, tokens: list[int], n_generated: int, worth: float, limit: int,
              expected_only: bool = False) -> list[int]:
        """`expected_only`: from an expected output only (many streams decode together)."""
        for source, expected in self.expected.items():
            n = self.acceptance[source].length(worth, limit)
            drafted = expected.draft(tokens, n_generated, n) if n else []
            if drafted:
                self.source = source
                return drafted
        if expected_only:
            return []
        best: tuple[int, list[int]] = (0, [])
        self.source = "prompt"
        for source, lookup in self.lookups.items():
            n = self.acceptance[source].length(worth, limit)
            found = lookup.draft(tokens, n) if n else (0, [])
            if found[1] and found[0] > best[0]:
                best, self.source = found, source
        return best[1]

    def record(self, drafted: int, accepted: int) -> None:
        self.acceptance[self.source].record(drafted, accepted)


def draft_row_worth(cost: StepCost, n_decode: int, n_prompt: int) -> float:
    """The acceptance chance at which one more draft row pays for itself. The row lengthens
    the step for all n_decode streams by a prompt token's cost and its logits (drafts are
    fitted with the prompt tokens; ROW_OVER_PROMPT_TOKEN prices the logits); accepted, it
    saves its own stream a whole step. Over the machine's work that is worth it when
    chance x step time > n_decode x row cost: with many streams, almost never."""
    step = cost.seconds(n_decode, n_prompt)
    row = cost.per_prompt * ROW_OVER_PROMPT_TOKEN
    return min(1.0, n_decode * row / step) if step > 0 else 1.0
