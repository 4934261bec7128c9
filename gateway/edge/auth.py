"""API keys: who is asking, as a tenant, from `Authorization: Bearer <key>`.

Keys come from `--api-keys-file` (one `key tenant` per line; `#` starts a comment) and from the
PREFIXGATE_API_KEYS variable (the same entries, separated by commas or newlines). A key may be
written as `sha256:<hex digest>`, so the file need not hold secrets. Only digests are kept in
memory, and a presented key is looked up by its digest.

The tenant is the cache namespace of its requests: tenants share no prefix, in the pool or in
live sequences, unless `--shared-prefix-tenants` names them as one group.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

SHARED_GROUP = "shared"  # the namespace of the tenants named in --shared-prefix-tenants


class KeyFileError(ValueError):
    pass


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether the header carries `key`, compared in constant time (no timing oracle)."""
    given = bearer_key(authorization)
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


@dataclass(frozen=True)
class KeyRing:
    tenants: dict[str, str]  # sha256 hex digest of a key -> its tenant
    shared: frozenset[str] = frozenset()  # tenants whose prefixes are one namespace

    @classmethod
    def load(cls, path: Path | None, entries: str | None,
             shared: frozenset[str] = frozenset()) -> KeyRing | None:
        """None when no key is configured: the gateway is open."""
        lines: list[tuple[str, str]] = []
        if path is not None:
            try:
                text = path.read_text()
            except OSError as exc:
                raise KeyFileError(f"cannot read the API keys file {path}: {exc}") from None
            lines += [(f"{path}:{n}", line) for n, line in enumerate(text.splitlines(), 1)]
        if entries:
            lines += [("PREFIXGATE_API_KEYS", line)
                      for line in entries.replace(",", "\n").splitlines()]
        tenants = {}
        for where, line in lines:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2:
                raise KeyFileError(f"{where}: expected `key tenant`, got {len(fields)} fields")
            key, tenant = fields
            tenants[key.removeprefix("sha256:").lower() if key.startswith("sha256:")
                    else digest(key)] = tenant
        return cls(tenants, shared) if tenants else None

    def identify(self, authorization: str | None) -> tuple[str, str] | None:
        """(the key's digest, its tenant) for a request's Authorization header, or None for a
        missing or wrong key."""
        key = bearer_key(authorization)
        if key is None:
            return None
        key_digest = digest(key)
        tenant = self.tenants.get(key_digest)
        return None if tenant is None else (key_digest, tenant)

    def namespace(self, tenant: str) -> str:
        return SHARED_GROUP if tenant in self.shared else f"tenant:{tenant}"
