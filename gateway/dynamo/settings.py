"""How a node joins Dynamo and a front finds the nodes (`--dynamo-*`): light, for the command
line to import."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DynamoSettings:
    endpoint: str = "dynamo.prefixgate.generate"  # namespace.component.endpoint
    model_dir: Path | None = None  # where the model directory is written; None: the cache's


def distributed_runtime(loop: asyncio.AbstractEventLoop) -> Any:
    """Dynamo's runtime on its own environment variables: discovery (DYN_DISCOVERY_BACKEND,
    etcd by default) and request plane (DYN_REQUEST_PLANE, tcp by default). Dynamo is imported
    here, when a node or a front starts: its Rust core is large and slow to load, and the plain
    gateway never needs it."""
    from dynamo.runtime import DistributedRuntime

    return DistributedRuntime(loop, os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                              os.environ.get("DYN_REQUEST_PLANE", "tcp"))
