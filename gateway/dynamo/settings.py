"""How a node joins Dynamo (`--dynamo-*`): light, for the command line to import."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DynamoSettings:
    endpoint: str = "dynamo.prefixgate.generate"  # namespace.component.endpoint
    model_dir: Path | None = None  # where the model directory is written; None: the cache's
