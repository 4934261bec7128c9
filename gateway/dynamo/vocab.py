"""A GGUF's vocabulary as a Hugging Face `tokenizers` tokenizer that gives llama.cpp's token ids,
for Dynamo's frontend, which tokenizes prompts itself (its KV router scores token blocks).

Two of llama.cpp's vocabulary types convert:
- byte-level BPE (`tokenizer.ggml.model` "gpt2"): the GGUF's merges, and the pre-tokenizer
  regexes llama.cpp applies for its `tokenizer.ggml.pre` (llama-vocab.cpp), one Split each, in
  the same order;
- SentencePiece ("llama"): llama.cpp merges the adjacent pair whose joined text is the
  highest-scored token, falling back to <0xXX> byte tokens; a BPE whose merges are every split
  of each token ranked by that token's score does the same.
Control tokens become special added tokens (parsed only when special tokens are), user-defined
ones plain added tokens (llama.cpp always cuts them out first). Anything else is a
`VocabularyError` naming what it cannot convert: never a tokenizer that silently differs.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

# llama.cpp's token types (llama_token_type)
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (llama-vocab.cpp); the
# types whose merges it ignores for a word that is a token already.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt-2", "mpt", "olmo", "jais", "trillion"), (GPT2,)),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva"), (r"\p{N}", GPT2)),
    **dict.fromkeys(("llama3", "llama-bpe", "dbrx", "smaug-bpe"), (LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "hunyuan"), (QWEN2,)),
}
IGNORES_MERGES = frozenset(("llama3", "llama-bpe"))


# GGUF metadata value types (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): struct
# formats of the fixed-size ones; 8 is a string, 9 an array.
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: str) -> dict:
    """A GGUF's metadata, key -> value (a list for an array). Read here rather than by gguf's
    GGUFReader, which makes numpy views of every part of every value: the same values, 10.5 s
    for Gemma 3's 262,144 tokens on a busy machine against 0.2 s here (2.4 s and 0.05 s for
    SmolLM2's)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
        (n_kv,) = struct.unpack_from("<Q", m, 16)
        metadata, pos = {}, 24

        def string(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, pos)
            return m[pos + 8:pos + 8 + n].decode(), pos + 8 + n

        def value(value_type: int, pos: int) -> tuple[object, int]:
            if value_type in _FORMATS:
                fmt = "<" + _FORMATS[value_type]
                return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)
            if value_type == _STRING:
                return string(pos)
            if value_type != _ARRAY:
                raise ValueError(f"{path}: unknown GGUF value type {value_type} at {pos}")
            element_type, count = struct.unpack_from("<IQ", m, pos)
            pos += 12
            if element_type in _FORMATS:
                fmt = f"<{count}{_FORMATS[element_type]}"
                return list(struct.unpack_from(fmt, m, pos)), pos + struct.calcsize(fmt)
            items = []
            for _ in range(count):
                item, pos = value(element_type, pos)
                items.append(item)
            return items, pos

        for _ in range(n_kv):
            key, pos = string(pos)
            (value_type,) = struct.unpack_from("<I", m, pos)
            metadata[key], pos = value(value_type, pos + 4)
        return metadata


class VocabularyError(ValueError):
    """The GGUF's vocabulary cannot be converted (its type is named)."""


@dataclass(frozen=True)
class Vocabulary:
    """What the GGUF says of its tokenizer."""

    kind: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    bos: int | None
    eos: int | None
    unknown: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    @classmethod
    def read(cls, path: str) -> Vocabulary:
        value = gguf_metadata(path).get

        kind = value("tokenizer.ggml.model", "")
        tokens = value("tokenizer.ggml.tokens", [])
        return cls(kind, value("tokenizer.ggml.pre", "default"), tokens,
                   value("tokenizer.ggml.token_type", [NORMAL] * len(tokens)),
                   value("tokenizer.ggml.scores", [0.0] * len(tokens)),
                   value("tokenizer.ggml.merges", []),
                   value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id"),
                   value("tokenizer.ggml.unknown_token_id"),
                   bool(value("tokenizer.ggml.add_bos_token", kind == "llama")),
                   bool(value("tokenizer.ggml.add_eos_token", False)),
                   bool(value("tokenizer.ggml.add_space_prefix", kind == "llama")),
                   value("tokenizer.chat_template"))

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def tokenizer_of(vocab: Vocabulary) -> Tokenizer:
    """The tokenizer, or a VocabularyError naming the type (and pre-tokenizer) it cannot
    convert."""
    if vocab.kind == "gpt2":
        tokenizer = _byte_level_bpe(vocab)
    elif vocab.kind == "llama":
        tokenizer = _sentencepiece(vocab)
    else:
        raise VocabularyError(
            f"cannot convert the GGUF's {vocab.kind!r} vocabulary into a tokenizer.json for "
            "Dynamo's frontend: only byte-level BPE ('gpt2') and SentencePiece ('llama') "
            "vocabularies convert")
    _add_special_tokens(tokenizer, vocab)
    _add_framing(tokenizer, vocab)
    return tokenizer


def _byte_level_bpe(vocab: Vocabulary) -> Tokenizer:
    regexes = PRE_TOKENIZERS.get(vocab.pre)
    if regexes is None:
        raise VocabularyError(
            f"cannot convert the GGUF's byte-level BPE vocabulary with pre-tokenizer "
            f"{vocab.pre!r} for Dynamo's frontend: its splitting is not known here (known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))})")
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    tokenizer = Tokenizer(models.BPE(
        {token: i for i, token in enumerate(vocab.tokens)}, merges,
        ignore_merges=vocab.pre in IGNORES_MERGES))
    tokenizer.pre_tokenizer = pre.Sequence(
        [pre.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(vocab: Vocabulary) -> Tokenizer:
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(models.BPE(ids, _merges_by_score(vocab, ids),
                                     unk_token=vocab.token(vocab.unknown), fuse_unk=True,
                                     byte_fallback=True))
    steps = [normalizers.Replace(" ", "▁")]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    return tokenizer


def _merges_by_score(vocab: Vocabulary, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every normal token into two tokens, the highest-scored token's first:
    the order in which llama.cpp's SentencePiece tokenizer joins pairs."""
    ranked = []
    for token, kind, score in zip(vocab.tokens, vocab.types, vocab.scores, strict=True):
        if kind != NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, vocab: Vocabulary) -> None:
    def added(kind: int, special: bool) -> list[AddedToken]:
        return [AddedToken(token, special=special, normalized=False)
                for token, t in zip(vocab.tokens, vocab.types, strict=True) if t == kind]

    tokenizer.add_special_tokens(added(CONTROL, True))
    tokenizer.add_tokens(added(USER_DEFINED, False))


def _add_framing(tokenizer: Tokenizer, vocab: Vocabulary) -> None:
    """The BOS and EOS llama.cpp adds when asked for special tokens."""
    bos = vocab.token(vocab.bos) if vocab.add_bos else None
    eos = vocab.token(vocab.eos) if vocab.add_eos else None
    if bos is None and eos is None:
        return
    single = " ".join(filter(None, (bos, "$A", eos)))
    pair = " ".join(filter(None, (bos, "$A", eos, bos, "$B", eos)))
    special = [(t, i) for t, i in ((bos, vocab.bos), (eos, vocab.eos)) if t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                             special_tokens=special)
