"""The only module that talks to llama.cpp: a model (weights, vocabulary, metadata), one context
that decodes many sequences per call, a reusable token batch and per-request sampler chains.

Everything here is a thin, typed layer over llama-cpp-python's low-level ctypes API, because its
high-level `Llama` class drives a single sequence and cannot batch several requests per decode.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re

import llama_cpp as lc
import numpy as np

from engine.config import ContextShape
from engine.devices import Device, ModelShape, Placement
from engine.messages import MemoryBuffer, SamplerSettings

log = logging.getLogger(__name__)

# ggml_log_level: 3 = WARN, 4 = ERROR (2 = INFO, 1 = DEBUG, 5 = CONT are dropped)
_LLAMA_LOG_LEVELS = {3: logging.WARNING, 4: logging.ERROR}


# llama.cpp warns of a "possible training context overflow" whenever a context's n_ctx_seq
# passes the model's training context, and with unified KV n_ctx_seq is the whole pool of cells,
# whatever one request may hold. The engine says in its own line whether a request can go past
# the training context (engine/batching.py, a warning then), so this one is information.
_RESTATED_WARNINGS = (b"possible training context overflow",)


# What llama.cpp allocated, read from its INFO lines as it loads a model and creates contexts
# ("load_tensors: Vulkan0 model buffer size = 33.01 MiB"): it has no API for it that
# llama-cpp-python wraps (llama-server logs the same lines: loadtest/gpu_bench.py reads them).
# (buffer, kind) -> MiB, added up over the process's contexts.
BUFFER_LINE = re.compile(rb"(\S+) +(model|KV|RS|compute|output) buffer size = +([0-9.]+) MiB")
_allocated: dict[tuple[str, str], float] = {}


@lc.llama_log_callback
def _forward_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if level == 2 and (found := BUFFER_LINE.search(text)):
        key = (found[1].decode(), found[2].decode())
        _allocated[key] = _allocated.get(key, 0.0) + float(found[3])
    # llama.cpp is chatty at INFO level; pass on only warnings and errors.
    if level in _LLAMA_LOG_LEVELS:
        severity = logging.INFO if any(note in text for note in _RESTATED_WARNINGS) \
            else _LLAMA_LOG_LEVELS[level]
        log.log(severity, "llama.cpp: %s", text.decode(errors="replace").rstrip())


# A module-level reference keeps the callback alive: llama.cpp crashes if it is garbage-collected.
lc.llama_log_set(_forward_llama_log, ctypes.c_void_p(0))
lc.llama_backend_init()


KV_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}  # by config.KV_TYPE_NAMES


class ModelLoadError(RuntimeError):
    pass


class DecodeError(RuntimeError):
    pass


class KVCacheFull(DecodeError):
    """llama_decode found no free cells for the batch; the context is unchanged."""


def openmp_build() -> bool:
    """True when llama.cpp was built with OpenMP, whose thread team decodes ~3x slower when
    `llama_decode` is called from any thread but the process's main one (the engine's is not):
    build with -DGGML_OPENMP=OFF for ggml's own threadpool."""
    return b"OPENMP = 1" in lc.llama_print_system_info()


def runtime_version() -> str:
    """The llama-cpp-python release, which pins the llama.cpp build and its KV layout."""
    return lc.__version__


# ggml's registry of backends and their devices (ggml-backend.h), which llama-cpp-python does
# not wrap: the functions are found through libllama, which links them.
_ggml = lc.llama_cpp._lib
for _name, _restype, _argtypes in (
        ("ggml_backend_dev_count", ctypes.c_size_t, []),
        ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
        ("ggml_backend_dev_by_name", ctypes.c_void_p, [ctypes.c_char_p]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
        ("ggml_backend_dev_memory", None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(ctypes.c_size_t)]),
        ("ggml_backend_reg_count", ctypes.c_size_t, []),
        ("ggml_backend_reg_get", ctypes.c_void_p, [ctypes.c_size_t]),
        ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p])):
    getattr(_ggml, _name).restype = _restype
    getattr(_ggml, _name).argtypes = _argtypes
_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # enum ggml_backend_dev_type
_SPLIT_MODES = {"none": lc.LLAMA_SPLIT_MODE_NONE, "layer": lc.LLAMA_SPLIT_MODE_LAYER,
                "row": lc.LLAMA_SPLIT_MODE_ROW}


def allocated() -> tuple[MemoryBuffer, ...]:
    """What llama.cpp allocated in this process so far: weights, KV, compute and output
    buffers, on each device and in host memory."""
    return tuple(MemoryBuffer(buffer, kind, int(mib * 2**20))
                 for (buffer, kind), mib in sorted(_allocated.items()))


def backends() -> list[str]:
    """The backends this llama.cpp build has: CPU, and Vulkan, CUDA, Metal... when built so."""
    return [_ggml.ggml_backend_reg_name(_ggml.ggml_backend_reg_get(i)).decode()
            for i in range(_ggml.ggml_backend_reg_count())]


def devices() -> list[Device]:
    """Every device the backends found, with its free and total memory now."""
    found = []
    for i in range(_ggml.ggml_backend_dev_count()):
        dev = _ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = _ggml.ggml_backend_dev_type(dev)
        found.append(Device(_ggml.ggml_backend_dev_name(dev).decode(),
                            _ggml.ggml_backend_dev_description(dev).decode(errors="replace"),
                            _DEVICE_KINDS[kind] if kind < len(_DEVICE_KINDS) else "other",
                            free.value, total.value))
    return found


def model_shape(path: str, n_cells: int, kv_type: str) -> ModelShape:
    """What placing the model needs, from its metadata (its weights stay on disk): its layers,
    its size, and one layer's KV for `n_cells` cells."""
    model = Model(path, vocab_only=True)
    try:
        meta = model.metadata
        arch = meta.get("general.architecture", "")

        def number(key: str, default: int) -> int:
            value = meta.get(f"{arch}.{key}", "")
            return int(value) if value.isdigit() else default  # per-layer arrays: the default

        n_embd = number("embedding_length", 0)
        n_head = max(number("attention.head_count", 1), 1)
        n_head_kv = number("attention.head_count_kv", n_head)
        head_k = number("attention.key_length", n_embd // n_head)
        head_v = number("attention.value_length", head_k)
        cell_bytes = (head_k + head_v) * n_head_kv * (2 if kv_type == "f16" else 34 / 32)
        return ModelShape(number("block_count", 1), os.path.getsize(path),
                          int(cell_bytes * n_cells))
    finally:
        model.close()


class Model:
    """Weights and vocabulary. Read-only after loading, so tokenization may run on any thread.
    With `vocab_only` the weights stay on disk: enough to tokenize and render chat templates.
    `placement`: which layers go to which GPU devices; None: all stay on the CPU."""

    def __init__(self, path: str, vocab_only: bool = False,
                 placement: Placement | None = None) -> None:
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = vocab_only
        self.placement = placement
        if placement is not None and placement.on_device:
            self._offload(params, placement)
        self.path = path
        self.ptr = lc.llama_model_load_from_file(path.encode(), params)
        if not self.ptr:
            raise ModelLoadError(f"llama.cpp could not load a model from {path}")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = lc.llama_model_n_ctx_train(self.ptr)
        self.metadata = self._read_metadata()
        eog = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        self.eog_tokens = np.array(eog, dtype=np.int32)

    def _offload(self, params: lc.llama_model_params, placement: Placement) -> None:
        """The placement in llama.cpp's model parameters. The arrays are kept on the model:
        llama.cpp reads them while it loads."""
        params.n_gpu_layers = placement.gpu_layers
        self._devices = (ctypes.c_void_p * (len(placement.devices) + 1))(
            *(_ggml.ggml_backend_dev_by_name(d.name.encode()) for d in placement.devices), None)
        params.devices = ctypes.cast(self._devices, ctypes.c_void_p).value
        params.split_mode = _SPLIT_MODES[placement.split_mode]
        params.main_gpu = placement.main_gpu
        shares = list(placement.tensor_split)
        self._tensor_split = (ctypes.c_float * lc.llama_max_devices())(
            *shares, *[0.0] * (lc.llama_max_devices() - len(shares)))
        params.tensor_split = ctypes.cast(self._tensor_split, ctypes.POINTER(ctypes.c_float))

    def _read_metadata(self) -> dict[str, str]:
        metadata = {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(lc.llama_model_meta_count(self.ptr)):
            n = lc.llama_model_meta_key_by_index(self.ptr, i, buf, len(buf))
            key = buf.value.decode(errors="replace") if n >= 0 else ""
            n = lc.llama_model_meta_val_str_by_index(self.ptr, i, buf, len(buf))
            if n >= len(buf):  # a long value such as a chat template: retry with room for it
                big = ctypes.create_string_buffer(n + 1)
                lc.llama_model_meta_val_str_by_index(self.ptr, i, big, len(big))
                metadata[key] = big.value.decode(errors="replace")
            elif n >= 0:
                metadata[key] = buf.value.decode(errors="replace")
        return metadata

    @property
    def n_swa(self) -> int:
        """Positions a sliding-window layer attends to; 0 without such layers."""
        return lc.llama_model_n_swa(self.ptr)

    @property
    def has_recurrent_state(self) -> bool:
        """Recurrent (or hybrid) layers keep one state per sequence, not KV per position."""
        return bool(lc.llama_model_is_recurrent(self.ptr) or lc.llama_model_is_hybrid(self.ptr))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        capacity = len(data) + 8
        tokens = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_special,
                              parse_special)
        if n < 0:
            raise ValueError(f"tokenization needs {-n} tokens, more than expected")
        return list(tokens[:n])

    def token_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token stands for; special tokens render as nothing, as in OpenAI output,
        unless `special`."""
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n > len(buf):
            buf = ctypes.create_string_buffer(n)
            n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode(errors="replace")

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return lc.llama_vocab_get_text(self.vocab, token).decode(errors="replace")

    @property
    def adds_bos(self) -> bool:
        """Whether tokenizing a prompt puts a BOS token first."""
        return bool(lc.llama_vocab_get_add_bos(self.vocab))

    @property
    def bos_token(self) -> int:
        return lc.llama_vocab_bos(self.vocab)

    @property
    def eos_token(self) -> int:
        return lc.llama_vocab_eos(self.vocab)

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        if self.ptr:
            lc.llama_model_free(self.ptr)
            self.ptr = None


def builtin_chat_templates() -> frozenset[str]:
    """The names of the chat templates llama.cpp renders itself (in C++, not Jinja)."""
    n = lc.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    lc.llama_chat_builtin_templates(names, n)
    return frozenset(name.decode() for name in names)


def apply_builtin_template(name: str, messages: list[tuple[str, str]]) -> str:
    """A chat of (role, content) rendered by one of llama.cpp's built-in templates, ready for
    the answer. ValueError when it cannot render them."""
    keep = [(role.encode(), content.encode()) for role, content in messages]
    chat = (lc.llama_chat_message * len(keep))(*keep)
    size = 4096 + 2 * sum(len(role) + len(content) for role, content in keep)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(name.encode(), chat, len(keep), True, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp's {name} template could not render the chat")
        if n <= size:
            return buf.raw[:n].decode(errors="replace")
        size = n


class Context:
    """One llama.cpp context holding up to `n_seq_max` sequences. Used by the engine thread only.

    With unified KV all sequences draw cells from one pool, so `seq_cp` shares a prefix's cells
    between sequences without copying them; llama.cpp frees a cell when no sequence holds it."""

    def __init__(self, model: Model, shape: ContextShape) -> None:
        params = lc.llama_context_default_params()
        params.n_ctx = shape.n_ctx
        params.n_batch = shape.n_batch
        params.n_ubatch = shape.n_ubatch or shape.n_batch
        params.n_outputs_max = shape.n_outputs
        params.n_seq_max = shape.n_seq_max
        params.n_threads = shape.n_threads
        params.n_threads_batch = shape.n_threads
        params.kv_unified = shape.unified
        params.swa_full = shape.swa_full
        params.no_perf = True
        params.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if shape.flash_attn
                                  else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.type_k = params.type_v = KV_TYPES[shape.kv_type]
        if model.placement is not None:
            params.offload_kqv = model.placement.kv_offload
        self.model = model
        self.shape = shape
        self.ptr = lc.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise ModelLoadError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ptr)
        self._state_buffer = np.empty(0, np.uint8)

    def decode(self, batch: Batch) -> None:
        if self.shape.n_outputs and batch.n_logits > self.shape.n_outputs:
            # llama.cpp would abort the process: its buffers hold no more rows.
            raise DecodeError(f"a batch asks for {batch.n_logits} rows of logits; the context "
                              f"has room for {self.shape.n_outputs}")
        status = lc.llama_decode(self.ptr, batch.raw)
        if status == 1:
            raise KVCacheFull(f"no free KV cells for a batch of {len(batch)} tokens")
        if status != 0:
            raise DecodeError(f"llama_decode returned {status}")

    def logits(self, batch_index: int) -> np.ndarray:
        """A writable view of the logits of one batch position, valid until the next decode."""
        ptr = lc.llama_get_logits_ith(self.ptr, batch_index)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's hold on all its cells."""
        lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def clear(self) -> None:
        """Drop every cell; the next cells are taken from the first one on, as in a new
        context."""
        lc.llama_memory_clear(self.memory, False)

    def share(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Give `dst` the cells of `src` at positions [p0, p1): no data moves."""
        lc.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def sequence_state(self, seq_id: int, partial: bool = False) -> np.ndarray:
        """The serialised KV cells of one sequence (see cache/kv_codec.py for the layout), in a
        buffer reused from call to call: valid until the next call. `partial`: only the window
        section, or a recurrent model's state."""
        flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        size = lc.llama_state_seq_get_size_ext(self.ptr, seq_id, flags)
        if len(self._state_buffer) < size:
            self._state_buffer = np.empty(size, np.uint8)
        written = lc.llama_state_seq_get_data_ext(
            self.ptr, _uint8_pointer(self._state_buffer), size, seq_id, flags)
        return self._state_buffer[:written]

    def position_end(self, seq_id: int) -> int:
        """One past the last position the sequence holds (0 when it holds none)."""
        return lc.llama_memory_seq_pos_max(self.memory, seq_id) + 1

    def load_sequence_state(self, seq_id: int, blob: np.ndarray, partial: bool = False) -> None:
        """Replace a sequence's cells with serialised ones. `partial`: the blob holds only the
        window section, and only the sequence's window cells are replaced."""
        flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        if lc.llama_state_seq_set_data_ext(self.ptr, _uint8_pointer(blob), len(blob), seq_id,
                                           flags) != len(blob):
            raise DecodeError(f"llama.cpp refused {len(blob)} bytes of KV for sequence {seq_id}")

    def cut(self, seq_id: int, end: int) -> None:
        """Drop a sequence's hold on its cells from position `end` on."""
        lc.llama_memory_seq_rm(self.memory, seq_id, end, -1)

    def close(self) -> None:
        if self.ptr:
            lc.llama_free(self.ptr)
            self.ptr = None


def _uint8_pointer(array: np.ndarray):
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class Batch:
    """A reusable llama_batch; each token belongs to exactly one sequence."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.n_logits = 0  # rows of logits asked for
        self.raw = lc.llama_batch_init(capacity, 0, 1)
        self._tokens = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))[:] = 1

    def __len__(self) -> int:
        return self.raw.n_tokens

    def clear(self) -> None:
        self.raw.n_tokens = 0
        self.n_logits = 0

    def add(self, tokens: list[int], first_pos: int, seq_id: int, n_logits: int) -> int:
        """Append consecutive tokens of one sequence, the last `n_logits` of them with logits;
        returns the batch index of the first of those."""
        start, end = self.raw.n_tokens, self.raw.n_tokens + len(tokens)
        if end > self.capacity:
            raise ValueError("batch overflow")
        self._tokens[start:end] = tokens
        self._pos[start:end] = np.arange(first_pos, first_pos + len(tokens))
        self._logits[start:end] = 0
        self._logits[end - n_logits: end] = 1
        for i in range(start, end):
            self.raw.seq_id[i][0] = seq_id
        self.raw.n_tokens = end
        self.n_logits += n_logits
        return end - n_logits

    def close(self) -> None:
        lc.llama_batch_free(self.raw)


# How far down the likeliest tokens a greedy pick looks for one the grammar allows before it
# masks the whole vocabulary (a few ms for this model's 49k tokens).
GREEDY_SEARCH = 256
# The first few of those are found one argmax at a time (~4 us over 49k logits each), the rest
# with one partial sort (~0.6 ms): the allowed token is nearly always among the first few.
GREEDY_TRIES = 8
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Candidates:
    """One llama_token_data_array over the whole vocabulary, reused by every sampling call of
    the engine thread: filling it is two memory copies, where a Python loop would cost a
    vocabulary's worth of calls."""

    def __init__(self, n_vocab: int) -> None:
        fresh = np.zeros(n_vocab, _TOKEN_DATA)
        fresh["id"] = np.arange(n_vocab, dtype=np.int32)
        self._data = fresh.copy()
        # As plain words: numpy copies a structured array field by field, ten times slower.
        self._fresh_words, self._words = fresh.view(np.int32), self._data.view(np.int32)
        self._pointer = self._data.ctypes.data_as(lc.llama_token_data_p)
        self.raw = lc.llama_token_data_array(self._pointer, n_vocab, -1, False)
        self.ref = ctypes.byref(self.raw)

    def fill(self, logits: np.ndarray) -> None:
        self._words[:] = self._fresh_words  # samplers sort and truncate the array in place
        self._data["logit"] = logits
        self.raw.data, self.raw.size = self._pointer, len(self._data)
        self.raw.selected, self.raw.sorted = -1, False

    @property
    def selected(self) -> int:
        return self.raw.data[self.raw.selected].id

    def logits(self) -> np.ndarray:
        return self._data["logit"][: self.raw.size]

    def none_allowed(self) -> bool:
        """Every candidate masked out (-inf), as a grammar and a ban can leave them."""
        return bool(np.isneginf(self.logits()).all())


class Sampler:
    """A llama.cpp sampler chain for one request, with its grammar kept apart as llama-server
    keeps it: the chain picks a token, and only that token is checked against the grammar. The
    grammar pass over the whole vocabulary runs only when the pick is rejected. The chain keeps
    the penalty history, so each request owns one."""

    def __init__(self, settings: SamplerSettings, model: Model, penalty_window: int,
                 logit_bias: dict[int, float] | None = None, ban_eog: bool = False) -> None:
        s, n_vocab = settings, model.n_vocab
        self.ptr = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        self._end = model.eos_token if model.eos_token >= 0 else int(model.eog_tokens[0])
        self.grammar: lc.llama_sampler_p | None = None
        self.eog_ban: lc.llama_sampler_p | None = None
        self.scripted = bool(s.script)
        self.script = list(reversed(s.script))  # popped from the end
        if s.grammar is not None:
            self.grammar = _grammar_sampler(model, s.grammar, s.grammar_triggers)
            if self.grammar is None:
                self.close()
                raise ValueError("llama.cpp could not parse the output grammar")
        if ban_eog:  # applied only while the request may not end (ignore_eos, min_tokens)
            self.eog_ban = _logit_bias_sampler(
                n_vocab, {int(t): -np.inf for t in model.eog_tokens})
        if logit_bias:
            self._add(_logit_bias_sampler(n_vocab, logit_bias))
        if s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0:
            self._add(lc.llama_sampler_init_penalties(
                n_vocab, penalty_window, s.repetition_penalty, s.frequency_penalty,
                s.presence_penalty))
        self.greedy = s.temperature <= 0.0
        # Greedy with no bias or penalty: numpy's argmax on the logits picks what the chain
        # would (the first of equal maxima), without copying the vocabulary into candidates.
        self._plain_greedy = self.greedy and lc.llama_sampler_chain_n(self.ptr) == 0
        self._eog_tokens = np.asarray(model.eog_tokens, dtype=np.int64)
        if self.greedy:
            self._add(lc.llama_sampler_init_greedy())
            return
        if s.top_k > 0:
            self._add(lc.llama_sampler_init_top_k(s.top_k))
        if s.top_p < 1.0:
            self._add(lc.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            self._add(lc.llama_sampler_init_min_p(s.min_p, 1))
        self._add(lc.llama_sampler_init_temp(s.temperature))
        seed = lc.LLAMA_DEFAULT_SEED if s.seed is None else s.seed & 0xFFFFFFFF
        self._add(lc.llama_sampler_init_dist(seed))

    def _add(self, sampler: lc.llama_sampler_p) -> None:
        lc.llama_sampler_chain_add(self.ptr, sampler)

    def sample(self, ctx: Context, batch_index: int, candidates: Candidates,
               allow_eog: bool = True) -> int:
        if self.scripted:
            return self.script.pop() if self.script else self._end
        if self.greedy:
            token = self._best_allowed(self._greedy_logits(ctx, batch_index, candidates,
                                                           allow_eog))
        else:
            token = self._pick(ctx, batch_index, candidates, allow_eog, with_grammar=False)
            if self.grammar is not None and not self._grammar_allows(token):
                token = None
        if token is None:  # the grammar rejected the likeliest: mask the whole vocabulary
            token = self._pick(ctx, batch_index, candidates, allow_eog, with_grammar=True)
            if token is None:
                # The grammar allows nothing but its end (ignore_eos, min_tokens): the output
                # is complete, so it ends. Accepting any other token would break the grammar.
                return self._end
        lc.llama_sampler_accept(self.ptr, token)
        if self.grammar is not None:
            lc.llama_sampler_accept(self.grammar, token)
        return token

    def _greedy_logits(self, ctx: Context, batch_index: int, candidates: Candidates,
                       allow_eog: bool) -> np.ndarray:
        """The logits a greedy pick chooses from, by token id: with the ban on ending and the
        chain's bias and penalties applied (which change logits in place and keep the order)."""
        banned = not allow_eog and self.eog_ban is not None
        if self._plain_greedy:
            logits = ctx.logits(batch_index)
            if banned:
                logits = logits.copy()
                logits[self._eog_tokens] = -np.inf
            return logits
        candidates.fill(ctx.logits(batch_index))
        if banned:
            lc.llama_sampler_apply(self.eog_ban, candidates.ref)
        lc.llama_sampler_apply(self.ptr, candidates.ref)
        return candidates.logits()

    def _pick(self, ctx: Context, batch_index: int, candidates: Candidates, allow_eog: bool,
              with_grammar: bool) -> int | None:
        """The chain's choice; None when the grammar and the ban leave no token at all."""
        candidates.fill(ctx.logits(batch_index))
        if not allow_eog and self.eog_ban is not None:
            lc.llama_sampler_apply(self.eog_ban, candidates.ref)
        if with_grammar:
            lc.llama_sampler_apply(self.grammar, candidates.ref)
            if candidates.none_allowed():
                return None
        lc.llama_sampler_apply(self.ptr, candidates.ref)
        return candidates.selected

    def _best_allowed(self, logits: np.ndarray) -> int | None:
        """Greedy: the likeliest token (the lowest id of equal ones, as the chain's pick) the
        grammar allows among the GREEDY_SEARCH likeliest; None if none is. Bias and penalties
        act on each token alone, so this is the token a full grammar pass and then the chain
        would choose."""
        token = int(np.argmax(logits))
        if self.grammar is None or self._grammar_allows(token):
            return token
        left = logits.copy()  # the likeliest not yet tried, one argmax at a time
        for _ in range(min(GREEDY_TRIES, GREEDY_SEARCH) - 1):
            left[token] = -np.inf
            token = int(np.argmax(left))
            if left[token] == -np.inf:
                return None
            if self._grammar_allows(token):
                return token
        n = min(GREEDY_SEARCH, len(logits))
        if n == 0:
            return None
        top = np.argpartition(-logits, n - 1)[:n]
        for i in top[np.lexsort((top, -logits[top]))]:
            if logits[i] == -np.inf:
                return None
            if self._grammar_allows(int(i)):
                return int(i)
        return None

    def _grammar_allows(self, token: int) -> bool:
        one = lc.llama_token_data(token, 1.0, 0.0)
        single = lc.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        lc.llama_sampler_apply(self.grammar, ctypes.byref(single))
        return single.data[0].logit != -np.inf

    def close(self) -> None:
        for name in ("ptr", "grammar", "eog_ban"):
            sampler = getattr(self, name)
            if sampler:
                lc.llama_sampler_free(sampler)
                setattr(self, name, None)


def _grammar_sampler(model: Model, gbnf: str, triggers: tuple[str, ...]
                     ) -> lc.llama_sampler_p | None:
    """llama.cpp's grammar sampler; lazy with triggers (a tool call's grammar under `auto`)."""
    if not triggers:
        return lc.llama_sampler_init_grammar(model.vocab, gbnf.encode(), b"root") or None
    patterns = (ctypes.c_char_p * len(triggers))(*(t.encode() for t in triggers))
    return lc.llama_sampler_init_grammar_lazy_patterns(
        model.vocab, gbnf.encode(), b"root", patterns, len(triggers), None, 0) or None


def _logit_bias_sampler(n_vocab: int, bias: dict[int, float]) -> lc.llama_sampler_p:
    entries = (lc.llama_logit_bias * len(bias))(
        *(lc.llama_logit_bias(token, value) for token, value in bias.items()))
    return lc.llama_sampler_init_logit_bias(n_vocab, len(bias), entries)
