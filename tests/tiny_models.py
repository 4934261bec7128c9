"""Tiny GGUF files with random weights for the architectures no small real model on PyPI has: a
recurrent one (Mamba) and a hybrid one (LFM2: short convolutions beside attention layers); and
a Llama of four small layers and a Gemma 3 of six (five of them sliding-window), for the GPU tests
on a software device (make test-vulkan), where SmolLM2 and Gemma 3 270M would take minutes a
prompt.

Written with the `gguf` package, llama.cpp's own converter library, with SmolLM2's tokenizer.
Random weights are enough to prove that a restored state continues exactly as a recomputed one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from gateway.workers.model_store import MODEL_DIR, default_model_path

N_EMBD = 64


def tiny_model(architecture: str, model_dir: Path = MODEL_DIR) -> Path:
    """The model's file, written on first use (in about 5 s)."""
    path = model_dir / f"tiny-random-{architecture}.gguf"
    if not path.exists():
        partial = path.with_suffix(".part")
        writer = GGUFWriter(str(partial), architecture)
        n_vocab = _copy_tokenizer(writer, GGUFReader(str(default_model_path(model_dir))))
        {"mamba": _mamba, "lfm2": _lfm2, "llama": _llama, "gemma3": _gemma3}[architecture](
            writer, n_vocab, np.random.default_rng(0))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.rename(path)
    return path


def _copy_tokenizer(writer: GGUFWriter, reader: GGUFReader) -> int:
    for name, entry in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = entry.types[0]
            sub_type = entry.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(name, entry.contents(), kind, sub_type=sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def _random(rng: np.random.Generator, *shape: int, scale: float = 0.2) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


def _llama(w: GGUFWriter, n_vocab: int, rng: np.random.Generator, n_layer: int = 4,
           n_embd: int = 256, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 512) -> None:
    """Keys and tensors as llama.cpp's src/models/llama.cpp reads them; heads of 64 dimensions,
    which every backend's flash attention takes. The output layer is the embeddings' (tied)."""
    for key, value in {"context_length": 4096, "embedding_length": n_embd,
                       "block_count": n_layer, "feed_forward_length": n_ff,
                       "attention.head_count": n_head, "attention.head_count_kv": n_head_kv,
                       "rope.dimension_count": n_embd // n_head}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    _decoder(w, n_vocab, rng, n_layer, n_embd, n_head, n_head_kv, n_ff)


def _gemma3(w: GGUFWriter, n_vocab: int, rng: np.random.Generator, n_layer: int = 6,
            n_embd: int = 256, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 512,
            window: int = 32) -> None:
    """Keys and tensors as llama.cpp's src/models/gemma3.cpp reads them: every sixth layer
    attends to the whole context, the others to the last `window` positions; its norms after
    attention and the FFN, and on each head's queries and keys, are ones."""
    head_dim = n_embd // n_head
    for key, value in {"context_length": 4096, "embedding_length": n_embd,
                       "block_count": n_layer, "feed_forward_length": n_ff,
                       "attention.head_count": n_head, "attention.head_count_kv": n_head_kv,
                       "attention.key_length": head_dim, "attention.value_length": head_dim,
                       "attention.sliding_window": window}.items():
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.rope.freq_base", 1e6)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    _decoder(w, n_vocab, rng, n_layer, n_embd, n_head, n_head_kv, n_ff, {
        "post_attention_norm.weight": n_embd, "post_ffw_norm.weight": n_embd,
        "attn_q_norm.weight": head_dim, "attn_k_norm.weight": head_dim})


def _decoder(w: GGUFWriter, n_vocab: int, rng: np.random.Generator, n_layer: int,
             n_embd: int, n_head: int, n_head_kv: int, n_ff: int,
             more_norms: dict[str, int] | None = None) -> None:
    """A decoder's tensors: F16 embeddings (the output layer ties to them), and layers of
    attention and a gated FFN with their norms, and `more_norms` (name -> size), all ones."""
    head_dim = n_embd // n_head
    w.add_tensor("token_embd.weight", _random(rng, n_vocab, n_embd, scale=1.0)
                 .astype(np.float16))
    w.add_tensor("output_norm.weight", _ones(n_embd))
    for i in range(n_layer):
        norms = {"attn_norm.weight": n_embd, "ffn_norm.weight": n_embd} | (more_norms or {})
        for name, size in norms.items():
            w.add_tensor(f"blk.{i}.{name}", _ones(size))
        for name, tensor in {
                "attn_q.weight": _random(rng, n_head * head_dim, n_embd),
                "attn_k.weight": _random(rng, n_head_kv * head_dim, n_embd),
                "attn_v.weight": _random(rng, n_head_kv * head_dim, n_embd),
                "attn_output.weight": _random(rng, n_embd, n_head * head_dim),
                "ffn_gate.weight": _random(rng, n_ff, n_embd),
                "ffn_up.weight": _random(rng, n_ff, n_embd),
                "ffn_down.weight": _random(rng, n_embd, n_ff)}.items():
            w.add_tensor(f"blk.{i}.{name}", tensor)


def _mamba(w: GGUFWriter, n_vocab: int, rng: np.random.Generator, n_layer: int = 2,
           d_state: int = 16, d_conv: int = 4, dt_rank: int = 4) -> None:
    """Keys and tensors as llama.cpp's src/models/mamba.cpp reads them (numpy shapes are
    ggml's reversed); d_inner must be 2 * n_embd."""
    d_inner = 2 * N_EMBD
    for key, value in {"context_length": 4096, "embedding_length": N_EMBD,
                       "block_count": n_layer, "ssm.conv_kernel": d_conv,
                       "ssm.inner_size": d_inner, "ssm.state_size": d_state,
                       "ssm.time_step_rank": dt_rank}.items():
        w.add_uint32(f"mamba.{key}", value)
    w.add_float32("mamba.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", _random(rng, n_vocab, N_EMBD, scale=1.0))
    w.add_tensor("output_norm.weight", _ones(N_EMBD))
    for i in range(n_layer):
        for name, tensor in {
                "attn_norm.weight": _ones(N_EMBD),
                "ssm_in.weight": _random(rng, 2 * d_inner, N_EMBD),
                "ssm_conv1d.weight": _random(rng, d_inner, d_conv, scale=0.3),
                "ssm_conv1d.bias": _random(rng, d_inner, scale=0.02),
                "ssm_x.weight": _random(rng, dt_rank + 2 * d_state, d_inner),
                "ssm_dt.weight": _random(rng, d_inner, dt_rank),
                "ssm_dt.bias": _random(rng, d_inner, scale=0.1),
                "ssm_a": -np.exp(_random(rng, d_inner, d_state, scale=0.5)),
                "ssm_d": _ones(d_inner),
                "ssm_out.weight": _random(rng, N_EMBD, d_inner)}.items():
            w.add_tensor(f"blk.{i}.{name}", tensor)


def _lfm2(w: GGUFWriter, n_vocab: int, rng: np.random.Generator, n_ff: int = 128,
          n_head: int = 4, layer_kv_heads: tuple[int, ...] = (0, 2, 0, 2),
          l_cache: int = 3) -> None:
    """Keys and tensors as llama.cpp's src/models/lfm2.cpp reads them: a layer with 0 KV heads
    is a short-convolution (recurrent) one."""
    head_dim = N_EMBD // n_head
    for key, value in {"context_length": 4096, "embedding_length": N_EMBD,
                       "block_count": len(layer_kv_heads), "feed_forward_length": n_ff,
                       "attention.head_count": n_head, "shortconv.l_cache": l_cache}.items():
        w.add_uint32(f"lfm2.{key}", value)
    w.add_array("lfm2.attention.head_count_kv", list(layer_kv_heads))
    w.add_float32("lfm2.rope.freq_base", 1e6)
    w.add_float32("lfm2.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", _random(rng, n_vocab, N_EMBD, scale=1.0))
    w.add_tensor("token_embd_norm.weight", _ones(N_EMBD))
    for i, kv_heads in enumerate(layer_kv_heads):
        tensors = {"attn_norm.weight": _ones(N_EMBD), "ffn_norm.weight": _ones(N_EMBD),
                   "ffn_gate.weight": _random(rng, n_ff, N_EMBD),
                   "ffn_up.weight": _random(rng, n_ff, N_EMBD),
                   "ffn_down.weight": _random(rng, N_EMBD, n_ff)}
        if kv_heads:
            tensors |= {"attn_q_norm.weight": _ones(head_dim),
                        "attn_k_norm.weight": _ones(head_dim),
                        "attn_q.weight": _random(rng, N_EMBD, N_EMBD),
                        "attn_k.weight": _random(rng, kv_heads * head_dim, N_EMBD),
                        "attn_v.weight": _random(rng, kv_heads * head_dim, N_EMBD),
                        "attn_output.weight": _random(rng, N_EMBD, N_EMBD)}
        else:
            tensors |= {"shortconv.conv.weight": _random(rng, N_EMBD, l_cache, scale=0.3),
                        "shortconv.in_proj.weight": _random(rng, 3 * N_EMBD, N_EMBD),
                        "shortconv.out_proj.weight": _random(rng, N_EMBD, N_EMBD)}
        for name, tensor in tensors.items():
            w.add_tensor(f"blk.{i}.{name}", tensor)
