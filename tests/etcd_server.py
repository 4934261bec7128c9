"""A real etcd (Debian's `etcd-server`, installed by `make system-deps`) for the Dynamo tests:
started on a free port with a data directory of its own, stopped with SIGTERM, and read through
its HTTP gateway (the v3 API as JSON): the keys under a prefix, and the TTL each lease was
granted with."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path

from loadtest.gateway_process import ServerProcess, free_port


class Etcd(ServerProcess):
    """`hosts`: the addresses it listens on for clients, the first the one it is reached at
    (more for nodes in network namespaces of their own)."""

    def __init__(self, data_dir: Path, hosts: tuple[str, ...] = ("127.0.0.1",)) -> None:
        peer = f"http://127.0.0.1:{free_port()}"
        super().__init__(
            ["etcd", "--name", "test", "--data-dir", str(data_dir),
             "--listen-client-urls", ",".join(f"http://{h}:{{port}}" for h in hosts),
             "--advertise-client-urls", f"http://{hosts[0]}:{{port}}",
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}"],
            "/health", data_dir.with_suffix(".log"), host=hosts[0])

    def _call(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.base_url + path, json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def keys(self, prefix: str) -> list[str]:
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])  # etcd's range end for "every key under"
        found = self._call("/v3/kv/range", {"key": base64.b64encode(start).decode(),
                                            "range_end": base64.b64encode(end).decode(),
                                            "keys_only": True})
        return [base64.b64decode(kv["key"]).decode() for kv in found.get("kvs", [])]

    def lease_ttls(self) -> list[int]:
        """The TTL, in seconds, each lease alive was granted with."""
        leases = self._call("/v3/lease/leases", {}).get("leases", [])
        return [int(self._call("/v3/lease/timetolive", {"ID": lease["ID"]})["grantedTTL"])
                for lease in leases]
