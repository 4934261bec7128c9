"""The models a gateway serves, each by its name: its vocabulary (prompts are rendered and
tokenized in the HTTP process), its engines (the worker processes that hold its weights, its
contexts and its own block pool), and whether it has loaded. Every API routes a request by its
`model` to one of them (Gateway.require_model) and reads what the request needs of the model
(its template, its context's length, its pool) there."""

from __future__ import annotations

import asyncio
import logging
import threading

from cache.fingerprint import gguf_fingerprint
from engine.llama import Model
from gateway.config import ModelConfig
from gateway.core.engines import Engines
from gateway.edge.errors import APIError
from gateway.formats.prompts import PromptBuilder
from gateway.workers.shared_pool import SharedPool
from gateway.workers.supervisor import Workers

log = logging.getLogger(__name__)


class ServedModel:
    def __init__(self, config: ModelConfig, engines: Engines | None = None) -> None:
        """`engines`: who runs its requests; engine workers of its own by default."""
        self.config = config
        self.name = config.name
        self.vocab: Model | None = None  # vocabulary only: the weights live in the workers
        self.prompts: PromptBuilder | None = None
        self.engines: Engines = engines or Workers(config.workers)
        # Its GGUF's: what its token ids mean (stored responses keep it beside theirs).
        self.fingerprint = ""
        self.load_error: str | None = None
        self._loaded = threading.Event()

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.load_error is None

    @property
    def state(self) -> str:
        """As /v1/models lists it (llama-server's router's words)."""
        if not self._loaded.is_set():
            return "loading"
        return "failed" if self.load_error else "loaded"

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """On a thread: the vocabulary, then the engines, until they serve or fail (the
        failure is kept, for its requests' errors and /v1/models)."""
        path = self.config.workers.model_path
        try:
            self.vocab = Model(path, vocab_only=True)
            self.prompts = PromptBuilder(self.vocab, self.config.chat_template)
            self.fingerprint = gguf_fingerprint(path)
            self.engines.start(loop)
            log.info("serving %s as %r", path, self.name)
        except Exception as exc:
            log.exception("starting the model %r (%s) failed", self.name, path)
            self.load_error = str(exc)
        finally:
            self._loaded.set()

    def require_pool(self) -> SharedPool:
        """Its block pool, for the cache's operator APIs (explain, admin)."""
        if self.engines.pool is None:
            raise APIError(404, "This server holds no prefix cache of its own: it runs with "
                           "--no-prefix-cache, or is a front whose cache is on its Dynamo "
                           "nodes (ask a node)", code="cache_disabled")
        return self.engines.pool

    def close(self) -> None:
        self.engines.stop()
        if self.vocab is not None:
            self.vocab.close()
