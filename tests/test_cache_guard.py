"""Block caching is refused, with a log line, for models whose KV is not per-position."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from engine.config import CacheConfig
from engine.prefix_cache import cacheable_layout


def test_smollm2_kv_splits_into_position_blocks(local_model):
    assert not local_model.has_recurrent_state and local_model.n_swa == 0


def test_recurrent_model_gets_no_cache(caplog):
    model = SimpleNamespace(has_recurrent_state=True, n_swa=0)
    with caplog.at_level(logging.WARNING):
        assert cacheable_layout(model, ctx=None, config=CacheConfig()) is None
    assert "recurrent state" in caplog.text


def test_disabled_cache_is_none(local_model):
    assert cacheable_layout(local_model, ctx=None, config=CacheConfig(enabled=False)) is None
