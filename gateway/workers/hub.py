"""Models from the Hugging Face hub by name (`--hf-repo owner/name[:quant]`, `--hf-file`), as
llama-server's `-hf` and Ollama's pull: the GGUF (every part of a split one) is downloaded into
a models cache, resumed after an interruption, checked against the hub's size and digest, then
served like any other file.

The hub's own HTTP API, with the standard library only (a download happens before the server
starts, and a second HTTP client would be a dependency for one request per file):
- `GET {endpoint}/api/models/{repo}/tree/main?recursive=true` lists the files, each with its size
  and, for the large (LFS) ones, `lfs.oid`: the file's sha256;
- `HEAD {endpoint}/{repo}/resolve/main/{path}` answers an LFS file with a redirect to its CDN
  whose headers carry `X-Linked-Size` and `X-Linked-Etag` (its sha256), a small file in git
  itself with 200, its git blob id as `ETag`;
- the file is then read from where the redirect points, resumed with `Range`.
`HF_ENDPOINT` is the hub's base URL (a mirror), `HF_TOKEN` is sent as a bearer token (gated and
private repos) to the hub only, never to the CDN it redirects to, and `HF_HUB_OFFLINE=1` asks
nothing of the network, as huggingface_hub reads them.

The quant is chosen as llama-server chooses it (common/download.cpp): `:Q4_K_M` takes the model
file whose path has `Q4_K_M.` or `Q4_K_M-` in it, in any case; without one, Q4_K_M, else Q8_0,
else the first model file. Projectors (mmproj) and importance matrices are no models.

The cache holds `{cache}/{owner}/{name}/{path in the repo}`: a file is there under its own name
only once complete and verified (it is written as `.part` and renamed), beside a `.sha256` (or
`.gitoid`) file with the digest it was verified against; a later start takes it without reading
it again while the hub lists that digest, and when the hub cannot be reached."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urljoin, urlsplit

from gateway.workers.model_files import SPLIT_PART, ModelsError

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama-server's choice when the repo is named alone
NOT_MODELS = ("mmproj", "imatrix")  # GGUFs beside a model that are no model of their own
QUANT_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")  # the quant at a file stem's end
CHUNK = 1 << 20
PROGRESS_SECONDS = 5.0  # a log line at most this often, and at every tenth of the file
TIMEOUT = 60.0  # seconds a request may wait for a byte


class HubError(ModelsError):
    """What was asked cannot be fetched: the message names the repo, the file and why."""


class HubUnreachable(OSError):
    """No answer from the hub at all (as opposed to an HTTP error, which is an answer)."""


@dataclass(frozen=True)
class HubFile:
    path: str  # in the repo, `/`-separated
    size: int | None
    sha256: str | None  # an LFS file's
    git_oid: str | None  # a file in git itself: sha1 of "blob {size}\0" + its bytes


@dataclass(frozen=True)
class Hub:
    endpoint: str
    cache: Path
    token: str | None = None
    offline: bool = False
    attempts: int = 3  # reads of one file before giving up (each resumes where the last ended)

    @classmethod
    def from_environment(cls, cache: Path | None) -> Hub:
        return cls((os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
                   cache or default_cache(), os.environ.get("HF_TOKEN") or None,
                   os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"))

    def pull(self, spec: str, hf_file: str | None = None) -> Path:
        """The local path of `spec`'s model (a split model's first part, the others beside it),
        downloaded and verified first unless the cache has it. Raises HubError."""
        repo, tag = parse_spec(spec)
        listed = None if self.offline else self._listing(repo)
        if listed is None:  # offline, or the hub did not answer: what the cache has
            cached = self._cached(repo)
            parts = choose(spec, tag, hf_file, [HubFile(p, None, None, None) for p in cached])
            log.warning("%s: the hub (%s) is %s: serving %s from the cache", spec, self.endpoint,
                        "not asked (HF_HUB_OFFLINE)" if self.offline else "unreachable",
                        ", ".join(f.path for f in parts))
            return self.cache / repo / parts[0].path
        parts = choose(spec, tag, hf_file, listed)
        for part in parts:
            self._fetch(repo, part)
        return self.cache / repo / parts[0].path

    # -- listing --

    def _listing(self, repo: str) -> list[HubFile] | None:
        """Every file of the repo (None when the hub cannot be reached)."""
        url: str | None = f"{self.endpoint}/api/models/{repo}/tree/main?recursive=true"
        files: list[HubFile] = []
        try:
            while url:
                with self._open("GET", url, repo) as response:
                    entries = json.load(response)
                    url = _next_page(response.headers.get("Link"), url)
                files += [HubFile(e["path"], e.get("size"), (e.get("lfs") or {}).get("oid"),
                                  None if e.get("lfs") else e.get("oid"))
                          for e in entries if e.get("type") == "file"]
        except HubUnreachable as exc:
            log.warning("%s: cannot reach the hub at %s: %s", repo, self.endpoint, exc)
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not the hub's JSON
            raise HubError(f"{repo}: {self.endpoint} answered its listing with what the hub's "
                           f"API does not ({type(exc).__name__}: {exc}): is HF_ENDPOINT a "
                           f"hub?") from None
        return files

    def _cached(self, repo: str) -> list[str]:
        """The repo's files complete in the cache (a `.part` is not)."""
        root = self.cache / repo
        found = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.gguf")) \
            if root.is_dir() else []
        if not found:
            raise HubError(f"{repo}: the hub at {self.endpoint} cannot be reached and "
                           f"{root} has no GGUF of it")
        return found

    # -- one file --

    def _fetch(self, repo: str, file: HubFile) -> None:
        target = self.cache / repo / _safe(file.path)
        if _verified(target, file):
            log.info("%s/%s: in the cache (%s), verified", repo, file.path, target)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        # One download per file across processes: two gateways started at once would
        # otherwise append to the same .part (the second then finds it done).
        with _locked(target.with_name(target.name + ".lock")):
            if _verified(target, file):
                return
            url = f"{self.endpoint}/{repo}/resolve/main/{quote(file.path)}"
            size, sha256, git_oid, source = self._resolve(url, repo, file)
            part = target.with_name(target.name + ".part")
            kind = "sha256" if sha256 else "gitoid"
            digest = _Digest(kind, size)
            self._download(source, repo, file.path, part, size, digest)
            digest.catch_up(part, size)
            got, got_size = digest.hexdigest(), part.stat().st_size
            if got != (sha256 or git_oid) or got_size != size:
                part.unlink()  # never resumed from: its bytes are wrong somewhere
                raise HubError(f"{repo}/{file.path}: the download does not match the hub "
                               f"({got_size} bytes, {kind} {got}; the hub says {size} bytes, "
                               f"{sha256 or git_oid}): removed, start again to download it "
                               f"anew")
            for suffix in (".sha256", ".gitoid"):
                target.with_name(target.name + suffix).unlink(missing_ok=True)
            part.rename(target)  # atomic: a file under its own name is complete and verified
            target.with_name(f"{target.name}.{kind}").write_text(f"{sha256 or git_oid}\n")
            log.info("%s/%s: downloaded to %s, %d bytes, %s verified", repo, file.path, target,
                     size, kind)

    def _resolve(self, url: str, repo: str, file: HubFile
                 ) -> tuple[int, str | None, str | None, str]:
        """(size, sha256, git blob id, where to read it) from the resolve URL's own headers,
        which an LFS file answers with a redirect to its CDN."""
        with self._open("HEAD", url, repo, follow=False) as response:
            headers = response.headers
            source = urljoin(url, headers["Location"]) if 300 <= response.status < 400 \
                else url
        linked = _etag(headers.get("X-Linked-Etag"))
        size = int(headers.get("X-Linked-Size") or headers.get("Content-Length") or -1)
        if size < 0:
            size = file.size if file.size is not None else -1
        sha256 = linked if linked and len(linked) == 64 else file.sha256
        git_oid = None if sha256 else (_etag(headers.get("ETag")) or file.git_oid)
        if size < 0 or not (sha256 or git_oid):
            raise HubError(f"{repo}/{file.path}: the hub gave no size or digest to check the "
                           f"download against ({url})")
        if file.sha256 and sha256 != file.sha256:
            log.warning("%s/%s: the listing's sha256 %s differs from the file's %s (updated "
                        "meanwhile): checking against the file's", repo, file.path,
                        file.sha256, sha256)
        return size, sha256, git_oid, source

    def _download(self, url: str, repo: str, path: str, part: Path, size: int,
                  digest: _Digest) -> None:
        """`url` into `part` until it holds `size` bytes, resuming what an earlier run or
        attempt left there with a Range request; `digest` takes each byte as it is written."""
        for attempt in range(1, self.attempts + 1):
            have = part.stat().st_size if part.exists() else 0
            if have > size:
                part.unlink()  # not this file: start again
                have = 0
            if have == size:
                return
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                with self._open("GET", url, repo, headers=headers) as response:
                    if have and response.status != 206:  # the range was ignored: start again
                        log.info("%s/%s: the server does not resume; from the start", repo, path)
                        have = 0
                    elif have:
                        log.info("%s/%s: resuming at %d of %d bytes", repo, path, have, size)
                    digest.catch_up(part, have)
                    self._copy(response, part, have, size, f"{repo}/{path}", digest)
                if part.stat().st_size == size:
                    return
            except (HubUnreachable, OSError, HTTPException) as exc:
                log.warning("%s/%s: the download stopped at %d of %d bytes (%s)%s", repo, path,
                            part.stat().st_size if part.exists() else 0, size, exc,
                            "; again" if attempt < self.attempts else "")
        raise HubError(f"{repo}/{path}: the download stopped {self.attempts} times at "
                       f"{part.stat().st_size if part.exists() else 0} of {size} bytes; "
                       f"{part} is kept and the next start resumes it")

    @staticmethod
    def _copy(response, part: Path, have: int, size: int, name: str, digest: _Digest
              ) -> None:
        done, started, shown = have, time.monotonic(), time.monotonic()
        next_tenth = (done * 10 // size + 1) if size else 10
        with part.open("r+b" if have else "wb") as out:
            out.seek(have)
            out.truncate()
            while chunk := response.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                now = time.monotonic()
                if done * 10 >= next_tenth * size or now - shown >= PROGRESS_SECONDS:
                    next_tenth = done * 10 // size + 1
                    shown = now
                    log.info("%s: %d%% (%.1f of %.1f MiB, %.1f MiB/s)", name, 100 * done // size,
                             done / 2**20, size / 2**20,
                             (done - have) / 2**20 / max(now - started, 1e-3))

    # -- HTTP --

    @contextlib.contextmanager
    def _open(self, method: str, url: str, repo: str, headers: dict[str, str] | None = None,
              follow: bool = True) -> Iterator:
        """The response to `method url`, redirects followed by hand (unless `follow` is
        false): the token goes to the hub's own origin only, never to a CDN it points at.
        An HTTP error is a HubError saying what it means; no answer is HubUnreachable."""
        for _ in range(8):
            sent = dict(headers or {}, **{"User-Agent": "prefixgate"})
            if self.token and _origin(url) == _origin(self.endpoint):
                sent["Authorization"] = f"Bearer {self.token}"
            request = urllib.request.Request(url, method=method, headers=sent)
            try:
                response = _NO_REDIRECTS.open(request, timeout=TIMEOUT)
            except urllib.error.HTTPError as exc:
                if exc.code >= 500:  # the hub is down: as if unreachable (the cache serves)
                    raise HubUnreachable(f"{url}: {exc.code} {exc.reason}") from None
                if not 300 <= exc.code < 400:
                    raise self._refused(exc, repo, url) from None
                response = exc  # a redirect: an HTTPError is also the response
            except (urllib.error.URLError, OSError) as exc:
                raise HubUnreachable(f"{url}: {getattr(exc, 'reason', exc)}") from None
            if 300 <= response.status < 400 and follow:
                url = urljoin(url, response.headers["Location"])
                response.close()
                continue
            with response:
                yield response
            return
        raise HubError(f"{repo}: too many redirects ({url})")

    def _refused(self, exc: urllib.error.HTTPError, repo: str, url: str) -> HubError:
        code, reason = exc.code, exc.headers.get("X-Error-Code", "")
        message = exc.headers.get("X-Error-Message") or exc.reason
        if reason == "RepoNotFound" or (code == 404 and "/api/models/" in url):
            return HubError(f"no repository {repo} on {self.endpoint} ({code}: {message}); "
                            f"a gated or private one needs HF_TOKEN too")
        if code in (401, 403) or reason == "GatedRepo":
            token = "HF_TOKEN was sent and has no access to it" if self.token \
                else "set HF_TOKEN to a token with access to it"
            return HubError(f"{repo} is gated or private on {self.endpoint} ({code}: "
                            f"{message}): {token}")
        return HubError(f"{repo}: the hub answered {code} ({message}) to {url}")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003 - urllib's signature
        return None  # the 3xx comes back as an HTTPError: Hub._open follows it itself


_NO_REDIRECTS = urllib.request.build_opener(_NoRedirects)


def default_cache() -> Path:
    """`$XDG_CACHE_HOME/prefixgate/models`, else `~/.cache/prefixgate/models`. Not llama.cpp's
    $LLAMA_CACHE: its layout (the hub's snapshots of blobs by hash) is not this one, so each
    would download what the other has."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixgate" / "models"


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`owner/name[:quant]` -> (repo, quant or None)."""
    repo, _, tag = spec.partition(":")
    if repo.count("/") != 1 or not all(re.fullmatch(r"[\w.-]+", p) and p not in (".", "..")
                                       for p in repo.split("/")):
        raise HubError(f"--hf-repo {spec}: expected owner/name[:quant], as "
                       f"bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
    return repo, tag or None


def choose(spec: str, tag: str | None, hf_file: str | None, files: list[HubFile]
           ) -> list[HubFile]:
    """The files of the model `spec` asks for: one, or every part of a split one in order."""
    ggufs = [f for f in files if f.path.endswith(".gguf")]
    models = [f for f in ggufs if _is_model(f.path)]
    primary = None
    if hf_file:
        primary = next((f for f in files if f.path.lower() == hf_file.lower()), None)
    else:
        for quant in [tag] if tag else DEFAULT_QUANTS:
            pattern = re.compile(re.escape(quant) + r"[.-]", re.IGNORECASE)
            primary = next((f for f in models if pattern.search(f.path)), None)
            if primary:
                break
        if primary is None and not tag and models:
            primary = models[0]
    if primary is None:
        asked = f"file {hf_file!r}" if hf_file else f"quant {tag!r}" if tag else "GGUF model"
        quants = sorted({q for f in models if (q := quant_of(f.path))})
        raise HubError(f"--hf-repo {spec}: no {asked} in it; its quants: "
                       f"{', '.join(quants) or 'none'} (GGUF files: "
                       f"{', '.join(f.path for f in ggufs) or 'none'})")
    split = SPLIT_PART.match(primary.path.removesuffix(".gguf"))
    if split is None:
        return [primary]
    names = {f"{split['name']}-{i:05d}-of-{split['parts']}.gguf"
             for i in range(1, int(split["parts"]) + 1)}
    parts = sorted((f for f in files if f.path in names), key=lambda f: f.path)
    if len(parts) != len(names):
        raise HubError(f"--hf-repo {spec}: {primary.path} is one of {len(names)} parts; the "
                       f"repo has {len(parts)} of them")
    return parts


def quant_of(path: str) -> str | None:
    """The quant a file's name ends with (Q4_K_M for model-Q4_K_M-00001-of-00002.gguf)."""
    stem = PurePosixPath(path).name.removesuffix(".gguf")
    split = SPLIT_PART.match(stem)
    tag = QUANT_TAG.search(split["name"] if split else stem)
    return tag[1].upper() if tag else None


def _is_model(path: str) -> bool:
    """A model file or a split model's first part."""
    name = PurePosixPath(path).name
    split = SPLIT_PART.match(name.removesuffix(".gguf"))
    return not any(word in name for word in NOT_MODELS) and \
        (split is None or int(split["part"]) == 1)


def _safe(path: str) -> str:
    """A repo path as a relative path under the cache (the hub's listing is not trusted to
    stay inside it)."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or any(p in ("..", ".", "") for p in parts):
        raise HubError(f"the hub listed a file path this cache will not write: {path!r}")
    return str(PurePosixPath(*parts))


class _Digest:
    """The digest of a `.part` as it is written, so that a model of many GiB is not read again
    once downloaded: only the bytes an earlier run left are read, once, before resuming."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind, self.size = kind, size
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self.hash = hashlib.sha256() if self.kind == "sha256" else hashlib.sha1()  # noqa: S324
        if self.kind == "gitoid":  # git's blob id: sha1 of a header and the bytes
            self.hash.update(f"blob {self.size}\0".encode())

    def update(self, chunk: bytes) -> None:
        self.hash.update(chunk)
        self.count += len(chunk)

    def catch_up(self, part: Path, have: int) -> None:
        """Take the file's first `have` bytes (what is kept of it) if not taken yet."""
        if self.count > have:
            self._reset()
        if self.count < have:
            with part.open("rb") as f:
                f.seek(self.count)
                while self.count < have and (chunk := f.read(min(CHUNK, have - self.count))):
                    self.update(chunk)

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def _etag(value: str | None) -> str | None:
    return value.removeprefix("W/").strip('"') if value else None


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _next_page(link: str | None, url: str) -> str | None:
    """The hub pages a long listing with `Link: <...>; rel="next"`."""
    found = re.search(r'<([^>]+)>\s*;\s*rel="next"', link or "")
    return urljoin(url, found[1]) if found else None


def _verified(target: Path, file: HubFile) -> bool:
    """`target` is the file the hub lists: verified against the digest it lists now (a file
    updated on the hub since is downloaded again)."""
    expected = file.sha256 or file.git_oid
    digest_file = target.with_name(f"{target.name}.{'sha256' if file.sha256 else 'gitoid'}")
    try:
        return bool(expected) and digest_file.read_text().strip() == expected \
            and (file.size is None or target.stat().st_size == file.size)
    except OSError:
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
