"""The context's size against the model's training context: left at its default, --ctx-size
is a pool of cells shared by all sequences, and no request goes past the training context;
llama.cpp's warning that the pool does is explained by the engine, not passed on as a
warning. Given explicitly, requests may go past it, and the engine warns."""

from __future__ import annotations

import logging

import pytest

from engine.config import CacheConfig, EngineConfig
from tests.local_engine import LocalEngine


@pytest.mark.parametrize("explicit", [False, True])
def test_a_pool_past_the_training_context_warns_only_when_a_request_may_go_past_it(
        local_model, caplog, explicit):
    caplog.set_level(logging.INFO)
    n_ctx = local_model.n_ctx_train + 256  # as the default 16384 cells against 8192
    local = LocalEngine.start(local_model, EngineConfig(
        parallel=2, ctx_size=n_ctx, beyond_training=explicit, prefill_context=False,
        cache=CacheConfig(enabled=False)))
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                    and "training context" in r.getMessage()]
        said = [r.getMessage() for r in caplog.records]
        # llama.cpp said it, as information either way.
        assert any("n_ctx_seq" in line and "possible training context overflow" in line
                   for line in said), said
        if explicit:
            assert local.engine.seq_len == n_ctx
            assert any("past the model's training context" in line for line in warnings), said
        else:
            assert local.engine.seq_len == local_model.n_ctx_train
            assert not warnings, warnings
            assert any("is no overflow here" in line for line in said), said
    finally:
        local.stop()
