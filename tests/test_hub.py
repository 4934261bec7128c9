"""Models from the hub by name (--hf-repo), against a local stand-in for the Hugging Face hub
(nothing beyond the package registries is reachable here) that serves the hub's own paths and
headers: the API's tree listing, resolve URLs redirecting an LFS file to a CDN on another origin
with X-Linked-Size and X-Linked-Etag (its sha256), ETags, Range and 206, 401 with X-Error-Code
for a gated repo or one that does not exist. Its files are SmolLM2 (served by the real gateway,
which answers a chat through the SDK), a split GGUF written from the tiny random Llama, and a
few MiB of random bytes where only the download is under test."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from gateway.cli import build_parser, server_config
from gateway.workers.hub import Hub, HubError, HubFile, choose
from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import ROOT, ServerProcess, free_port
from tests.conftest import openai_client
from tests.tiny_models import tiny_model

TOKEN = "hf_" + "t" * 34
SMOL_REPO = "prefixgate-test/SmolLM2-135M-Instruct-GGUF"
SPLIT_REPO = "prefixgate-test/tiny-llama-split-GGUF"
BYTES_REPO = "prefixgate-test/bytes-GGUF"


@dataclass
class Blob:
    source: Path | bytes
    size: int
    sha256: str

    @classmethod
    def of(cls, source: Path | bytes) -> Blob:
        data = source.read_bytes() if isinstance(source, Path) else source
        return cls(source, len(data), hashlib.sha256(data).hexdigest())

    def read(self, start: int, length: int) -> bytes:
        if isinstance(self.source, bytes):
            return self.source[start:start + length]
        with self.source.open("rb") as f:
            f.seek(start)
            return f.read(length)


@dataclass
class FakeHub:
    """The hub's paths and headers on a free loopback port, in a thread of the test process.
    Its CDN answers on `localhost`, another origin than the hub's `127.0.0.1`, as the real CDN
    is another host: the token must not reach it."""

    repos: dict[str, dict[str, Blob]] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)  # repos whose files need TOKEN
    drop_once: set[str] = field(default_factory=set)  # sha256s whose next body is cut halfway
    lie: set[str] = field(default_factory=set)  # sha256s announced with another digest
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    down: bool = False  # every answer a 503
    port: int = 0

    def add(self, repo: str, path: str, source: Path | bytes) -> Blob:
        blob = self.repos.setdefault(repo, {})[path] = Blob.of(source)
        return blob

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{name}/tree/main", self._tree)
        app.router.add_get("/{owner}/{name}/resolve/main/{path:.+}", self._resolve)
        app.router.add_get("/cdn/{sha256}", self._cdn)
        app.middlewares.append(self._record)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            ready.set()

        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        assert ready.wait(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def seen(self, prefix: str) -> list[dict[str, str]]:
        """The headers of each request whose path starts with `prefix`."""
        return [headers for _, path, headers in self.requests if path.startswith(prefix)]

    @web.middleware
    async def _record(self, request: web.Request, handler):
        self.requests.append((request.method, request.path, dict(request.headers)))
        if self.down:
            raise web.HTTPServiceUnavailable()
        return await handler(request)

    def _repo(self, request: web.Request) -> tuple[str, dict[str, Blob]]:
        repo = f"{request.match_info['owner']}/{request.match_info['name']}"
        if repo not in self.repos:  # as the hub answers anyone for a repo it does not show
            raise web.HTTPUnauthorized(headers={"X-Error-Code": "RepoNotFound",
                                                "X-Error-Message": "Repository not found"})
        return repo, self.repos[repo]

    async def _tree(self, request: web.Request) -> web.Response:
        _, files = self._repo(request)
        return web.json_response([
            {"type": "file", "path": path, "size": blob.size, "oid": "0" * 40,
             "lfs": {"oid": blob.sha256, "size": blob.size, "pointerSize": 134}}
            for path, blob in files.items()])

    async def _resolve(self, request: web.Request) -> web.Response:
        repo, files = self._repo(request)
        if repo in self.gated and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            raise web.HTTPUnauthorized(headers={
                "X-Error-Code": "GatedRepo",
                "X-Error-Message": f"Access to model {repo} is restricted."})
        blob = files.get(request.match_info["path"])
        if blob is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        sha256 = hashlib.sha256(b"not it").hexdigest() if blob.sha256 in self.lie \
            else blob.sha256
        raise web.HTTPFound(f"http://localhost:{self.port}/cdn/{blob.sha256}?signed=1", headers={
            "X-Linked-Size": str(blob.size), "X-Linked-Etag": f'"{sha256}"',
            "ETag": f'"{sha256}"', "X-Repo-Commit": "1" * 40})

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        sha256 = request.match_info["sha256"]
        blob = next(b for files in self.repos.values() for b in files.values()
                    if b.sha256 == sha256)
        asked = re.fullmatch(r"bytes=(\d+)-", request.headers.get("Range", ""))
        start = int(asked[1]) if asked else 0
        response = web.StreamResponse(status=206 if asked else 200, headers={
            "Accept-Ranges": "bytes", "Content-Length": str(blob.size - start),
            "ETag": f'"{sha256}"',
            **({"Content-Range": f"bytes {start}-{blob.size - 1}/{blob.size}"} if asked
               else {})})
        await response.prepare(request)
        cut = start + (blob.size - start) // 2 if sha256 in self.drop_once else None
        self.drop_once.discard(sha256)
        position = start
        while position < blob.size:
            chunk = blob.read(position, min(1 << 20, blob.size - position,
                                            (cut or blob.size) - position))
            await response.write(chunk)
            position += len(chunk)
            if position == cut:  # the connection drops mid-body
                request.transport.close()
                return response
        await response.write_eof()
        return response


def split_gguf(source: Path, directory: Path) -> list[Path]:
    """`source` rewritten as gguf-split writes a model: NAME-0000N-of-0000M.gguf."""
    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(directory / "tiny-llama-F32.gguf"),
                        reader.fields["general.architecture"].contents(), split_max_tensors=20)
    for name, entry in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            kind = entry.types[0]
            writer.add_key_value(name, entry.contents(), kind,
                                 sub_type=entry.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape,
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(directory.glob("tiny-llama-F32-*-of-*.gguf"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """SmolLM2 in a gated repo beside a projector (no model) and a README; a split GGUF; and
    random bytes under three quants."""
    hub = FakeHub()
    hub.add(SMOL_REPO, "mmproj-SmolLM2-135M-Instruct-Q4_1.gguf", b"GGUF not a model" * 64)
    hub.add(SMOL_REPO, "SmolLM2-135M-Instruct.Q4_1.gguf", default_model_path())
    hub.add(SMOL_REPO, "README.md", b"# SmolLM2\n")
    hub.gated.add(SMOL_REPO)
    for part in split_gguf(tiny_model("llama"), tmp_path_factory.mktemp("split")):
        hub.add(SPLIT_REPO, part.name, part)
    for quant in ("Q8_0", "Q4_K_M", "Q2_K"):
        hub.add(BYTES_REPO, f"bytes-{quant}.gguf", quant.encode() * (1 << 20))
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture
def bytes_hub(hub: FakeHub, tmp_path: Path) -> Hub:
    hub.requests.clear()
    return Hub(hub.endpoint, tmp_path / "models-cache", attempts=1)


def test_a_model_from_the_hub_is_downloaded_and_served(hub: FakeHub, tmp_path: Path):
    """Two repos, one gated (HF_TOKEN reaches the hub, never the CDN), one split in two parts:
    each downloaded, verified and served by the real gateway, which answers a chat by the
    repo's name through the SDK."""
    hub.requests.clear()
    cache = tmp_path / "models-cache"
    server = ServerProcess(
        [sys.executable, "-m", "gateway", "--hf-repo", f"{SMOL_REPO}:q4_1", "-hf", SPLIT_REPO,
         "--models-cache", str(cache), "--host", "127.0.0.1", "--port", "{port}",
         "--parallel", "1", "--ctx-size", "512", "--cache-mb", "64", "--temperature", "0"],
        "/health", ROOT / ".pytest_cache" / f"gateway-hub-{id(hub)}.log",
        env={"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN})
    try:
        client = openai_client(server)
        assert [m.id for m in client.models.list().data] == [
            "SmolLM2-135M-Instruct.Q4_1", "tiny-llama-F32"]
        answers = [client.chat.completions.create(
            model=name, max_tokens=8,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
            for name in (f"{SMOL_REPO}:q4_1", "SmolLM2-135M-Instruct.Q4_1")]
        assert answers[0].model == f"{SMOL_REPO}:q4_1"
        assert answers[0].choices[0].message.content.strip()
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        assert client.completions.create(model="tiny-llama-F32", prompt="Hello",
                                         max_tokens=4).usage.completion_tokens == 4
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert re.search(r"SmolLM2-135M-Instruct\.Q4_1\.gguf: \d+% \(", log)  # progress
    smol = cache / SMOL_REPO / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.read_bytes() == default_model_path().read_bytes()
    assert smol.with_name(smol.name + ".sha256").read_text().strip() == \
        hub.repos[SMOL_REPO][smol.name].sha256
    assert sorted(p.name for p in (cache / SPLIT_REPO).glob("*.gguf")) == sorted(
        hub.repos[SPLIT_REPO])
    assert not list(cache.rglob("*.part"))
    assert not (cache / SMOL_REPO / "mmproj-SmolLM2-135M-Instruct-Q4_1.gguf").exists()
    assert all(h.get("Authorization") == f"Bearer {TOKEN}" for h in hub.seen(f"/{SMOL_REPO}/"))
    assert hub.seen("/cdn/") and not any("Authorization" in h for h in hub.seen("/cdn/"))


def test_an_interrupted_download_resumes_with_a_range(hub: FakeHub, bytes_hub: Hub):
    blob = hub.repos[BYTES_REPO]["bytes-Q8_0.gguf"]
    hub.drop_once.add(blob.sha256)
    with pytest.raises(HubError, match="stopped 1 times .* next start resumes it"):
        bytes_hub.pull(f"{BYTES_REPO}:Q8_0")
    target = bytes_hub.cache / BYTES_REPO / "bytes-Q8_0.gguf"
    part = target.with_name(target.name + ".part")
    kept = part.stat().st_size
    assert 0 < kept < blob.size and not target.exists()
    assert bytes_hub.pull(f"{BYTES_REPO}:Q8_0") == target
    assert [h.get("Range") for h in hub.seen("/cdn/")] == [None, f"bytes={kept}-"]
    assert target.read_bytes() == blob.source and not part.exists()
    assert target.with_name(target.name + ".sha256").read_text().strip() == blob.sha256
    # Within one run: the next try resumes at once.
    other = hub.repos[BYTES_REPO]["bytes-Q4_K_M.gguf"]
    hub.drop_once.add(other.sha256)
    hub.requests.clear()
    path = Hub(hub.endpoint, bytes_hub.cache, attempts=2).pull(f"{BYTES_REPO}:Q4_K_M")
    assert [h.get("Range") for h in hub.seen("/cdn/")] == [None, f"bytes={other.size // 2}-"]
    assert path.read_bytes() == other.source


def test_a_file_that_does_not_match_the_hubs_sha256_is_not_kept(hub: FakeHub, bytes_hub: Hub):
    blob = hub.repos[BYTES_REPO]["bytes-Q2_K.gguf"]
    hub.lie.add(blob.sha256)
    try:
        with pytest.raises(HubError, match=r"bytes-Q2_K\.gguf: the download does not match"):
            bytes_hub.pull(f"{BYTES_REPO}:Q2_K")
    finally:
        hub.lie.discard(blob.sha256)
    left = {p.name for p in bytes_hub.cache.rglob("bytes-Q2_K.gguf*")}
    assert left == {"bytes-Q2_K.gguf.lock"}  # neither the file nor its .part


def test_a_cached_file_is_not_downloaded_again_and_serves_without_the_hub(
        hub: FakeHub, bytes_hub: Hub, caplog):
    """The default quant (Q4_K_M before the first file) downloaded once; the next start reads
    only the listing; with the hub unreachable, or HF_HUB_OFFLINE, the cache serves."""
    target = bytes_hub.pull(BYTES_REPO)
    assert target.name == "bytes-Q4_K_M.gguf" and len(hub.seen("/cdn/")) == 1
    hub.requests.clear()
    assert bytes_hub.pull(BYTES_REPO) == target
    assert [path for _, path, _ in hub.requests] == [f"/api/models/{BYTES_REPO}/tree/main"]
    hub.requests.clear()
    gone = Hub(f"http://127.0.0.1:{free_port()}", bytes_hub.cache)
    offline = Hub(hub.endpoint, bytes_hub.cache, offline=True)
    with caplog.at_level(logging.WARNING):
        assert gone.pull(BYTES_REPO) == offline.pull(f"{BYTES_REPO}:q4_k_m") == target
    assert not hub.requests
    hub.down = True
    try:
        assert bytes_hub.pull(BYTES_REPO) == target  # a hub answering 503: as unreachable
    finally:
        hub.down = False
    assert "unreachable: serving bytes-Q4_K_M.gguf from the cache" in caplog.text
    with pytest.raises(HubError, match=r"cannot be reached and .* has no GGUF of it"):
        gone.pull(SMOL_REPO)


def test_unknown_repo_quant_and_gated_repo_say_what_exists(hub: FakeHub, tmp_path: Path,
                                                           capsys, monkeypatch):
    cache = tmp_path / "models-cache"
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    parser = build_parser()
    for spec, error in [
            (f"{BYTES_REPO}:Q5_K_S", f"--hf-repo {BYTES_REPO}:Q5_K_S: no quant 'Q5_K_S' in it; "
                                     f"its quants: Q2_K, Q4_K_M, Q8_0 (GGUF files: "
                                     f"bytes-Q8_0.gguf, bytes-Q4_K_M.gguf, bytes-Q2_K.gguf)"),
            ("prefixgate-test/nothing-GGUF", "no repository prefixgate-test/nothing-GGUF on "
                                             f"{hub.endpoint} (401: Repository not found)"),
            (SMOL_REPO, f"{SMOL_REPO} is gated or private on {hub.endpoint} (401: Access to "
                        f"model {SMOL_REPO} is restricted.): set HF_TOKEN to a token with "
                        f"access to it"),
            ("no-owner", "--hf-repo no-owner: expected owner/name[:quant]")]:
        with pytest.raises(SystemExit):
            server_config(parser, parser.parse_args(["--hf-repo", spec,
                                                     "--models-cache", str(cache)]))
        assert error in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    with pytest.raises(HubError, match="HF_TOKEN was sent and has no access to it"):
        Hub.from_environment(cache).pull(SMOL_REPO)
    assert not list(cache.rglob("*.gguf"))


def test_a_preset_section_names_a_model_on_the_hub(hub: FakeHub, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    preset = tmp_path / "presets.ini"
    preset.write_text(f"[small]\nhf-repo = {BYTES_REPO}:Q8_0\ntemperature = 0.3\n")
    parser = build_parser()
    config = server_config(parser, parser.parse_args([
        "--hf-repo", f"{BYTES_REPO}:Q4_K_M", "--models-preset", str(preset),
        "--models-cache", str(tmp_path / "cache")]))
    first, small = config.models
    assert (first.name, first.aliases) == ("bytes-Q4_K_M", (f"{BYTES_REPO}:Q4_K_M",))
    assert (small.name, small.sampling.temperature) == ("small", 0.3)
    assert small.workers.model_path == str(tmp_path / "cache" / BYTES_REPO / "bytes-Q8_0.gguf")


@pytest.mark.parametrize(("tag", "hf_file", "chosen"), [
    ("q4_k_m", None, ["m-Q4_K_M.gguf"]),
    (None, None, ["m-Q4_K_M.gguf"]),  # llama-server's default quant before the first file
    ("Q8_0", None, ["big/m-Q8_0-00001-of-00002.gguf", "big/m-Q8_0-00002-of-00002.gguf"]),
    ("Q4_1", None, ["m.Q4_1.gguf"]),  # the projector with Q4_1 in its name is no model
    (None, "M.Q4_1.GGUF", ["m.Q4_1.gguf"]),
])
def test_the_quant_is_chosen_as_llama_server_does(tag, hf_file, chosen):
    files = [HubFile(p, 1, "0" * 64, None) for p in (
        "mmproj-m-Q4_1.gguf", "big/m-Q8_0-00002-of-00002.gguf", "big/m-Q8_0-00001-of-00002.gguf",
        "m.Q4_1.gguf", "m-Q4_K_M.gguf", "README.md")]
    assert [f.path for f in choose("o/m", tag, hf_file, files)] == chosen
    assert [f.path for f in choose("o/m", None, None, files[:4])] == [
        "big/m-Q8_0-00001-of-00002.gguf", "big/m-Q8_0-00002-of-00002.gguf"]  # Q8_0 next
