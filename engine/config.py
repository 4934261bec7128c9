"""How an engine is configured, in a module that does not load llama.cpp (`--help` reads it
without paying for that)."""

from __future__ import annotations

from dataclasses import dataclass

KV_TYPE_NAMES = ("f16", "q8_0")
SPLIT_MODES = ("none", "layer", "row")


@dataclass(frozen=True)
class Offload:
    """What of the model goes to the GPUs, as llama-server's flags say it
    (engine/devices.py resolves it against the devices llama.cpp finds)."""

    gpu_layers: int | str = "auto"  # a count, "all", or "auto": as many as the memory holds
    devices: tuple[str, ...] | None = None  # by llama.cpp's names (Vulkan0); None: all; (): none
    split_mode: str = "layer"  # across several devices: whole layers, or rows of each
    tensor_split: tuple[float, ...] = ()  # each device's share; (): by free memory
    main_gpu: int = 0  # with split_mode none: the one device used
    kv_offload: bool = True  # KV on the device with its layers; False: in host memory
    workers: int = 1  # worker processes, each with its own copy of the layers and its own KV


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True
    budget_mb: int = 1024
    block_size: int = 64


@dataclass(frozen=True)
class ContextShape:
    n_ctx: int  # KV cells of all sequences together
    n_seq_max: int
    n_batch: int  # tokens per llama_decode call, and per compute pass (n_ubatch)
    n_threads: int
    kv_type: str = "f16"
    flash_attn: bool = False
    unified: bool = True  # one cell pool for all sequences, or one stream of n_ctx / n_seq_max each
    n_ubatch: int | None = None  # tokens per compute pass; None: n_batch
    # Rows of logits one decode may ask for: llama.cpp reserves its compute buffers (on the
    # device, with layers there) for this many rows of the vocabulary. 0: n_batch.
    n_outputs: int = 0
    # A sliding-window model's window layers get KV cells for every position (llama.cpp's
    # library default) rather than for the last window of each sequence (llama-server's).
    swa_full: bool = False


@dataclass(frozen=True)
class EngineConfig:
    parallel: int = 8  # sequences decoded together
    ctx_size: int = 16384  # KV cells of all sequences together
    # An explicit --ctx-size: one request may then go past the model's training context (with
    # a warning, as llama-server allows); the default caps requests at it.
    beyond_training: bool = False
    # Tokens per llama_decode call: decodes first, prefill chunks after. 512 is llama-cpp-python's
    # n_batch, so that a request alone is prefilled in the same chunks and gets the same logits.
    batch_tokens: int = 512
    threads: int = 2
    kv_type: str | None = None  # None: the mode's own (f16, or q8_0 when deterministic)
    flash_attn: bool = True  # default mode only: the deterministic mode always uses it
    deterministic: bool = False
    swa_full: bool = False  # see ContextShape.swa_full; docs/architecture.md says why not
    # The time between a running stream's tokens that prompt chunks beside it may stretch a
    # step to (engine/scheduler.py). docs/scheduler.md has the measurement that chose it.
    target_tpot_ms: float = 1000
    # Tests only, never a flag: the prompt tokens a step takes beside running streams, in place
    # of what the measured step cost leaves within target_tpot_ms (and drafts weighed at the
    # prior cost, not the measured one), so that the same steps happen on any machine, however
    # busy. A server plans by the clock.
    step_tokens: int | None = None
    # Draft tokens from the request's own text and verify them in the step (engine/speculation.py).
    # None: on, unless the model's layers are on a GPU device, where a step verifying drafts
    # (more rows in its batch) rounds unlike single-token steps and greedy output can differ.
    speculation: bool | None = True
    # Compute a fresh prompt in a context of its own, away from the pool's other sequences'
    # cells, and move it into the pool when done (engine/prefill_context.py).
    prefill_context: bool = True
    cache: CacheConfig = CacheConfig()
    offload: Offload = Offload()

    def context_shape(self) -> ContextShape:
        if self.deterministic:
            # Q8_0 keeps every flash-attention call on the same row-by-row kernel whatever the
            # batch, and a stream per sequence fills its cells in position order, as alone.
            return ContextShape(n_ctx=self.ctx_size // self.parallel * self.parallel,
                                n_seq_max=self.parallel, n_batch=self.batch_tokens,
                                n_threads=self.threads, kv_type=self.kv_type or "q8_0",
                                flash_attn=True, unified=False, swa_full=self.swa_full)
        # F16 KV with flash attention, as llama-server runs on a CPU: a request alone gives the
        # tokens of llama-cpp-python's flash_attn=True (without it, of its defaults). One more
        # sequence id is the scratch used to move KV ranges. llama.cpp quantizes V only with
        # flash attention: q8_0 KV brings it along.
        kv_type = self.kv_type or "f16"
        return ContextShape(n_ctx=self.ctx_size, n_seq_max=self.parallel + 1,
                            n_batch=self.batch_tokens, n_threads=self.threads,
                            kv_type=kv_type, flash_attn=self.flash_attn or kv_type != "f16",
                            unified=True, swa_full=self.swa_full)
