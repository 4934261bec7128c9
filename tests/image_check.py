"""`make image-check`: the Dockerfile's steps run in clean Debian roots, where there is no Docker
engine and no registry of base images: what `docker build` would do on a machine with nothing
preinstalled, minus Docker's layer cache.

Each stage starts from a fresh stand-in for its base image, made by mmdebstrap from Debian's
packages; RUN, COPY, ENV, ARG, WORKDIR and USER then do in it what Docker does with them (RUN
under chroot, as the stage's user, with its environment). The last stage's ENTRYPOINT and CMD
then start the gateway in a network namespace of its own, and the HEALTHCHECK's command must
pass. Steps and their times are printed.

Run as root: python3 -m tests.image_check [--work DIR] [--keep] [--build-arg NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tests.dockerfile import ROOT, Instruction, arg_pair, docker_stages, env_pairs

# Stand-ins for the base images: Debian's release of the same name with its python3 as a
# virtual environment in /usr/local, where the official python images keep theirs (`python` and
# `pip` on PATH, pip free to install). Bookworm's Python is 3.11, as the image's.
BASES = {"python:3.11-slim-bookworm": "bookworm"}
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HEALTH_ATTEMPTS = 150  # two seconds apart: loading the model takes a few
SHM_SIZE = "2g"  # as compose's shm_size: the block pool lives in /dev/shm
# What RUN steps take from the host, as `docker build` does its predefined proxy ARGs: the
# proxies, and the TLS trust where the host names one (a machine behind an intercepting proxy,
# as this workplace's, reaches PyPI only with its CA), copied into the root.
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
                   "no_proxy")
TRUST_VARIABLES = ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
HOST_CA = "/etc/ssl/host-ca.crt"
# Metadata for the container, not steps of the build: used by the final health check.
METADATA = {"EXPOSE", "HEALTHCHECK", "STOPSIGNAL", "ENTRYPOINT", "CMD", "LABEL"}


@dataclass
class Stage:
    name: str
    root: Path
    args: dict[str, str] = field(default_factory=dict)  # ARGs: seen by RUN, not kept
    host: dict[str, str] = field(default_factory=dict)  # from the host: seen by RUN, not kept
    env: dict[str, str] = field(default_factory=dict)  # ENV: kept in the image
    workdir: str = "/"
    user: str = "0:0"
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Clock:
    steps: list[tuple[str, float]] = field(default_factory=list)

    def run(self, label: str, action, *args):
        print(f"==> {label}", flush=True)
        start = time.monotonic()
        result = action(*args)
        self.steps.append((label, time.monotonic() - start))
        return result

    def report(self) -> str:
        width = max(len(label) for label, _ in self.steps)
        lines = [f"{label:<{width}}  {seconds:7.1f} s" for label, seconds in self.steps]
        total = sum(seconds for _, seconds in self.steps)
        return "\n".join([*lines, f"{'total':<{width}}  {total:7.1f} s"])


def sh(*command: str) -> None:
    subprocess.run(command, check=True)


def base_tarball(suite: str, work: Path) -> Path:
    tarball = work / f"{suite}.tar"
    if not tarball.exists():
        sh("mmdebstrap", "--variant=minbase", "--mode=root", f"--include={','.join(BASE_PACKAGES)}",
           suite, str(tarball))
    return tarball


def chrooted(stage: Stage, argv: list[str], env: dict[str, str], user: str,
             workdir: str = "/") -> list[str]:
    """`argv` in the stage's root as `user`, with exactly `env` (and PATH, HOME)."""
    variables = {"PATH": PATH, "HOME": home_of(stage.root, user), **env}
    return ["chroot", f"--userspec={user}", str(stage.root), "/usr/bin/env", "-i", "-C", workdir,
            *(f"{k}={v}" for k, v in variables.items()), *argv]


def home_of(root: Path, user: str) -> str:
    """The user's home in the root's passwd, as Docker sets HOME (`/` when it has none)."""
    uid = user.split(":")[0]
    for line in (root / "etc" / "passwd").read_text().splitlines():
        fields = line.split(":")
        if uid in (fields[0], fields[2]):
            return fields[5]
    return "/"


def isolated(stage: Stage, script: str, network: bool = True) -> None:
    """A shell script in a mount namespace of its own where the root has /proc, /dev and a
    private /dev/shm (no network namespace: RUN steps fetch packages; the host's network)."""
    r = shlex.quote(str(stage.root))
    setup = (f"mount -t proc proc {r}/proc && mount --rbind /dev {r}/dev && "
             f"mount -t tmpfs -o size={SHM_SIZE} tmpfs {r}/dev/shm")
    if not network:
        setup += " && ip link set lo up"
    namespaces = ["--mount"] if network else ["--mount", "--net"]
    sh("unshare", *namespaces, "--propagation", "private", "--", "sh", "-ec",
       f"{setup}\n{script}")


def new_stage(name: str, base: str, work: Path) -> Stage:
    if base not in BASES:
        raise SystemExit(f"no stand-in for the base image {base}")
    stage = Stage(name, work / name)
    if stage.root.exists():
        shutil.rmtree(stage.root)
    stage.root.mkdir(parents=True)
    sh("tar", "-xf", str(base_tarball(BASES[base], work)), "-C", str(stage.root))
    shutil.copy("/etc/resolv.conf", stage.root / "etc" / "resolv.conf")
    stage.host = {v: os.environ[v] for v in PROXY_VARIABLES if v in os.environ}
    trust = next((os.environ[v] for v in TRUST_VARIABLES if os.environ.get(v)), None)
    if trust:
        shutil.copy(trust, stage.root / HOST_CA.lstrip("/"))
        stage.host |= dict.fromkeys(TRUST_VARIABLES, HOST_CA)
    isolated(stage, shlex.join(chrooted(stage, ["python3", "-m", "venv", "/usr/local"], {},
                                        "0:0")))
    return stage


def dockerignored() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip().rstrip("/") for line in lines if line.strip()
            and not line.startswith("#")]


def ignored(relative: PurePosixPath, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(str(relative), p)
               or (p.startswith("**/") and fnmatch.fnmatch(relative.name, p[3:]))
               for p in patterns)


def copy(stage: Stage, args: str, stages: dict[str, Stage]) -> None:
    """COPY [--from=STAGE] SRC... DEST: a directory's contents into DEST, files into DEST/ (or
    as DEST, one file to a path without a trailing slash)."""
    *sources, dest = shlex.split(args)
    origin, patterns = ROOT, dockerignored()
    if sources[0].startswith("--from="):
        origin, patterns = stages[sources.pop(0).removeprefix("--from=")].root, []
    if any(s.startswith("--") for s in sources):
        raise SystemExit(f"COPY {args}: flags other than --from are not handled here")
    target = stage.root / PurePosixPath(stage.workdir, dest).relative_to("/")
    into_dir = dest.endswith("/") or len(sources) > 1
    for source in sources:
        path = origin / source.lstrip("/")
        if ignored(PurePosixPath(source.lstrip("/")), patterns):
            raise SystemExit(f"COPY {source}: .dockerignore keeps it out of the context")
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True, ignore=lambda d, names: [
                n for n in names if ignored(PurePosixPath(d, n).relative_to(origin), patterns)])
        else:
            (target if into_dir else target.parent).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / path.name if into_dir else target)


def build_stage(instructions: list[Instruction], stages: dict[str, Stage], work: Path,
                build_args: dict[str, str], clock: Clock) -> Stage:
    words = shlex.split(instructions[0][1])
    name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
    stage = clock.run(f"{name}: a fresh root for {words[0]}", new_stage, name, words[0], work)
    for word, args in instructions[1:]:
        if word == "ARG":
            key, default = arg_pair(args)
            stage.args[key] = build_args.get(key, default or "")
        elif word == "ENV":
            stage.env.update(env_pairs(args))
        elif word == "WORKDIR":
            stage.workdir = str(PurePosixPath(stage.workdir, args))
            isolated(stage, shlex.join(chrooted(stage, ["mkdir", "-p", stage.workdir], {},
                                                stage.user)))
        elif word == "USER":
            stage.user = args
        elif word == "COPY":
            clock.run(f"{name}: COPY {args}", copy, stage, args, stages)
        elif word == "RUN":
            argv = json.loads(args) if args.startswith("[") else ["/bin/sh", "-c", args]
            command = chrooted(stage, argv, {**stage.host, **stage.args, **stage.env},
                               stage.user, stage.workdir)
            clock.run(f"{name}: RUN {args[:70]}", isolated, stage, shlex.join(command))
        elif word in METADATA:
            stage.metadata[word] = args
        else:
            raise SystemExit(f"{word} {args}: not handled here")
    stages[name] = stage
    return stage


def health_check(image: Stage, log: Path) -> None:
    """The image's ENTRYPOINT and CMD in a network namespace of their own (only loopback),
    until its HEALTHCHECK's command passes."""
    serve = chrooted(image, json.loads(image.metadata["ENTRYPOINT"])
                     + json.loads(image.metadata["CMD"]), image.env, image.user,
                     image.workdir)
    probe = chrooted(image, json.loads(image.metadata["HEALTHCHECK"].split("CMD", 1)[1]),
                     image.env, image.user, image.workdir)
    script = (f"{shlex.join(serve)} > {shlex.quote(str(log))} 2>&1 &\n"
              "server=$!\n"
              f"for attempt in $(seq {HEALTH_ATTEMPTS}); do\n"
              f"  if {shlex.join(probe)} 2>/dev/null; then kill -TERM $server; wait $server; "
              "exit 0; fi\n"
              "  kill -0 $server || exit 1\n"
              "  sleep 2\n"
              "done\n"
              "kill -KILL $server; exit 1")
    try:
        isolated(image, script, network=False)
    except subprocess.CalledProcessError:
        print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise SystemExit("the image's gateway never passed its HEALTHCHECK") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "image-check",
                        help="where the roots are made (removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the roots")
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    options = parser.parse_args()
    work = options.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    build_args = dict(arg.partition("=")[::2] for arg in options.build_arg)
    clock, stages = Clock(), {}
    try:
        for instructions in docker_stages():
            image = build_stage(instructions, stages, work, build_args, clock)
        clock.run("the image's gateway passes its HEALTHCHECK", health_check, image,
                  work / "gateway.log")
    finally:
        print(clock.report())
        if not options.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("image-check: every step of the Dockerfile ran, and the gateway it built is healthy")


if __name__ == "__main__":
    main()
