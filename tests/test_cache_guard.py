"""Block caching is refused, with a log line saying why, where blocks cannot keep a model's
state."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from engine.config import CacheConfig
from engine.prefix_cache import cacheable_layout


def test_smollm2_kv_splits_into_position_blocks(local_model):
    assert not local_model.has_recurrent_state and local_model.n_swa == 0


@pytest.mark.parametrize("model, unified, reason", [
    (SimpleNamespace(has_recurrent_state=True, n_swa=16), True, "hybrid model with sliding"),
    (SimpleNamespace(has_recurrent_state=False, n_swa=512), False, "deterministic mode"),
], ids=["hybrid with a sliding window", "sliding window, per-sequence streams"])
def test_what_blocks_cannot_keep_gets_no_cache(caplog, model, unified, reason):
    ctx = SimpleNamespace(shape=SimpleNamespace(unified=unified))
    with caplog.at_level(logging.WARNING):
        assert cacheable_layout(model, ctx=ctx, config=CacheConfig()) is None
    assert reason in caplog.text


def test_disabled_cache_is_none(local_model):
    assert cacheable_layout(local_model, ctx=None, config=CacheConfig(enabled=False)) is None
