"""GPU offload: llama-server's flags resolved against the devices llama.cpp finds
(engine/devices.py), and, in `make test-vulkan` (marked gpu), the real server with its layers on
a Vulkan device: Mesa's software one (lavapipe), slow, so a tiny random-weight Llama and short
prompts prove the paths, never the speed."""

from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from engine.config import Offload
from engine.devices import DEVICE_HEADROOM, Device, ModelShape, PlacementError, place
from gateway.cli import build_parser
from loadtest.gateway_process import GatewayProcess
from tests.conftest import across_a_restart, cached_and_uncached, openai_client
from tests.test_recurrent import ARGS as RECURRENT_ARGS
from tests.test_recurrent import complete, text
from tests.test_redis_tier import wait_stored
from tests.test_sliding_window import ARGS as WINDOW_ARGS
from tests.test_sliding_window import chat, rules
from tests.test_sliding_window import complete as complete_top5
from tests.test_workers import stream_events, wait_for_health, wait_running
from tests.tiny_models import tiny_model

MiB = 1 << 20
CPU = Device("CPU", "the host", "cpu", 8 << 30, 8 << 30)
BLAS = Device("BLAS", "a BLAS library", "accel", 0, 0)


def allocated(server: GatewayProcess) -> dict[tuple[str, str], float]:
    """Worker 0's prefixgate_worker_memory_bytes: (buffer, kind) -> bytes."""
    return {(s.labels["buffer"], s.labels["kind"]): s.value for s in server._samples()
            if s.name == "prefixgate_worker_memory_bytes" and s.labels["worker"] == "0"}


def gpu(name: str, free_mib: int) -> Device:
    return Device(name, "a test GPU", "gpu", free_mib * MiB, 2 * free_mib * MiB)


def shape() -> ModelShape:
    """30 layers and the output: 31 of 10 MiB weights each, and 4 MiB of KV a layer."""
    return ModelShape(n_layer=30, weight_bytes=310 * MiB, kv_bytes_per_layer=4 * MiB)


def test_without_a_gpu_device_every_layer_stays_on_the_cpu_whatever_is_asked():
    def unread() -> ModelShape:
        raise AssertionError("the model's file was opened with nothing to place")

    for layers in ("auto", "all", 12):
        placed = place(Offload(gpu_layers=layers), [CPU, BLAS], unread)
        assert placed.gpu_layers == 0 and not placed.on_device and placed.devices == ()
        assert placed.why == "no GPU device"
    assert place(Offload(gpu_layers="all", devices=()), [CPU, gpu("Vulkan0", 4096)],
                 unread).why == "--device none"


def test_all_and_a_count():
    found = [CPU, gpu("Vulkan0", 4096)]
    assert place(Offload(gpu_layers="all"), found, shape).gpu_layers == 31
    assert place(Offload(gpu_layers=12), found, shape).gpu_layers == 12
    assert place(Offload(gpu_layers=99), found, shape).gpu_layers == 31


def test_a_count_of_layers_the_device_cannot_hold_is_refused_before_loading():
    """14 MiB a layer (weights and KV): 4 fit in 64 MiB, 31 do not, and without their KV
    (10 MiB a layer) 6 do."""
    found = [CPU, gpu("Vulkan0", 64)]
    assert place(Offload(gpu_layers=4), found, shape).gpu_layers == 4
    assert place(Offload(gpu_layers=6, kv_offload=False), found, shape).gpu_layers == 6
    with pytest.raises(PlacementError, match=r"--n-gpu-layers all: 31 layers with their KV "
                                             r"need about 434 MiB on Vulkan0, which has 64 "
                                             r"MiB free: offload fewer layers"):
        place(Offload(gpu_layers="all"), found, shape)
    with pytest.raises(PlacementError, match=r"5 layers with their KV need about 70 MiB on "
                                             r"Vulkan0, which has 32 MiB free for each of 2 "
                                             r"workers"):
        place(Offload(gpu_layers=5, workers=2), found, shape)


def test_workers_take_a_device_each_and_those_sharing_one_divide_it():
    headroom = DEVICE_HEADROOM // MiB
    found = [CPU, gpu("CUDA0", headroom + 280), gpu("CUDA1", 2 * headroom + 280)]
    two = [place(Offload(workers=2), found, shape, worker) for worker in range(2)]
    assert [p.devices for p in two] == [(found[1],), (found[2],)]
    assert [p.gpu_layers for p in two] == [20, 31]  # each as much as its own device holds
    assert two[1].why.startswith("worker 1 of 2 on a device of its own; --n-gpu-layers auto")
    # Three workers on two devices: workers 0 and 2 share CUDA0, each with half of it.
    three = [place(Offload(workers=3), found, shape, worker) for worker in range(3)]
    assert [p.devices[0].name for p in three] == ["CUDA0", "CUDA1", "CUDA0"]
    assert [p.gpu_layers for p in three] == [10, 31, 10]
    assert three[2].why.startswith("worker 2 of 3 on a device shared by 2; ")
    # One device: every worker has a copy of the layers on it.
    shared = place(Offload(workers=2), found[:2], shape, 1)
    assert shared.gpu_layers == 10 and shared.why.startswith("2 workers share the device")
    # Split across both by one worker, or all on --main-gpu, as without workers.
    assert place(Offload(), found, shape).devices == tuple(found[1:])
    assert place(Offload(workers=2, split_mode="none", main_gpu=1), found, shape,
                 1).devices == (found[2],)


def test_auto_offloads_what_the_free_memory_holds_past_a_gib_per_device():
    headroom = DEVICE_HEADROOM // MiB
    # 20 layers of weights and KV (14 MiB each) fit, the 21st does not.
    placed = place(Offload(), [gpu("CUDA0", headroom + 20 * 14 + 5)], shape)
    assert placed.gpu_layers == 20 and placed.why.startswith("--n-gpu-layers auto: 20 of 31")
    # Without KV on the device, weights alone: 28 of 10 MiB.
    assert place(Offload(kv_offload=False), [gpu("CUDA0", headroom + 285)],
                 shape).gpu_layers == 28
    # Two devices' room together; a device with less free than the headroom adds nothing.
    found = [gpu("CUDA0", headroom + 140), gpu("CUDA1", headroom + 140), gpu("CUDA2", 500)]
    assert place(Offload(), found, shape).gpu_layers == 20
    assert place(Offload(), [gpu("CUDA0", 100 * 1024)], shape).gpu_layers == 31


def test_devices_by_name_and_split_mode_none_on_the_main_gpu():
    found = [CPU, gpu("Vulkan0", 4096), gpu("Vulkan1", 4096)]
    assert [d.name for d in place(Offload(gpu_layers="all"), found, shape).devices] == \
        ["Vulkan0", "Vulkan1"]
    named = place(Offload(gpu_layers="all", devices=("Vulkan1",)), found, shape)
    assert [d.name for d in named.devices] == ["Vulkan1"]
    alone = place(Offload(gpu_layers="all", split_mode="none", main_gpu=1), found, shape)
    # llama.cpp is given the one device, so its main GPU is that list's first.
    assert [d.name for d in alone.devices] == ["Vulkan1"] and alone.main_gpu == 0


@pytest.mark.parametrize(("offload", "says"), [
    (Offload(devices=("Vulkan7",)), "--device Vulkan7: no such GPU device (found: Vulkan0)"),
    (Offload(devices=("CPU",)), "--device CPU: no such GPU device"),
    (Offload(main_gpu=1), "--main-gpu 1: there are 1 device(s)"),
    (Offload(tensor_split=(3.0, 1.0)), "--tensor-split has 2 shares for 1 device(s)")])
def test_flags_naming_what_is_not_there_are_refused(offload, says):
    with pytest.raises(PlacementError, match=re.escape(says)):
        place(offload, [CPU, gpu("Vulkan0", 4096)], shape)


def test_the_flags_parse_as_llama_servers_do(monkeypatch):
    parse = build_parser().parse_args
    args = parse(["-ngl", "12", "-dev", "Vulkan0,Vulkan1", "-sm", "row", "-ts", "3,1",
                  "-mg", "1", "-nkvo"])
    assert (args.n_gpu_layers, args.device, args.split_mode, args.tensor_split,
            args.main_gpu, args.no_kv_offload) == (12, ("Vulkan0", "Vulkan1"), "row",
                                                   (3.0, 1.0), 1, True)
    assert parse(["--n-gpu-layers", "all", "--device", "none"]).device == ()
    defaults = parse([])
    assert (defaults.n_gpu_layers, defaults.device, defaults.no_kv_offload) == \
        ("auto", None, False)
    for bad in (["-ngl", "most"], ["-ts", "3,x"], ["-ts", "0,0"], ["--device", ","]):
        with pytest.raises(SystemExit):
            parse(bad)
    monkeypatch.setenv("PREFIXGATE_N_GPU_LAYERS", "all")
    assert build_parser().parse_args([]).n_gpu_layers == "all"


def test_the_cpu_build_serves_whatever_layers_are_asked_and_says_where_they_are():
    """A build without a GPU backend (make test's) ignores -ngl as llama-server does, and
    says so in the start-up log; naming a device that is not there stops the worker with the
    reason in the log, and /health says the model did not load."""
    server = GatewayProcess(tiny_model("llama"), "--n-gpu-layers", "all", "--parallel", "1",
                            "--ctx-size", "512")
    try:
        log = server.log_path.read_text()
        assert "llama.cpp backends: CPU" in log
        assert "every layer on the CPU (no GPU device)" in log
        answer = openai_client(server).completions.create(
            model=server.model_name, prompt="Hello", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens >= 1
        # What llama.cpp allocated: the KV of 512 cells and of the fresh prompts' own context
        # of 512 (4 layers, K and V of 2 heads of 64, f16: 2 KiB a cell), the weights mapped.
        memory = allocated(server)
        assert memory[("CPU", "KV")] == 1024 * 2048
        assert abs(memory[("CPU_Mapped", "model")] / tiny_model("llama").stat().st_size - 1) \
            < 0.05
        # Compute buffers for a row of logits per sequence and drafted token (17 of the 49,152
        # token vocabulary, 3.2 MiB), not for the whole batch of 512 (96 MiB, and as much
        # again for the fresh prompts' context, before).
        assert 0 < memory[("CPU", "compute")] < 16 * MiB
    finally:
        server.stop()
    # The gateway exits (a supervisor sees it); the error carries the log's tail.
    with pytest.raises(RuntimeError, match=re.escape(
            "--device Vulkan0: no such GPU device (found: none)")):
        GatewayProcess(tiny_model("llama"), "--device", "Vulkan0", "--parallel", "1",
                       "--ctx-size", "512")


# Every layer on the device, and two of them with the rest on the CPU (partial offload).
LAYERS = pytest.mark.parametrize("layers", ["all", "2"])


def on_the_device(layers: str) -> tuple[str, ...]:
    return "--n-gpu-layers", layers, "--device", "Vulkan0"
CHAT = [{"role": "user", "content": "Name three rivers of Europe and one of Asia, with the "
                                    "seas they flow into."}]
RULES = "The harbour keeper logs every ship that comes in, its flag, its cargo and its hour."


@pytest.mark.gpu
@pytest.mark.parametrize(("flags", "placed"), [
    (("--n-gpu-layers", "all"), "5 layers on Vulkan0 (--n-gpu-layers all)"),
    (("--n-gpu-layers", "2"), "2 layers on Vulkan0 (--n-gpu-layers 2)"),
    (("--n-gpu-layers", "all", "--no-kv-offload"),
     "5 layers on Vulkan0, their KV in host memory (--n-gpu-layers all)")],
    ids=["all", "partial", "kv-on-host"])
def test_layers_on_a_vulkan_device_serve_and_a_pool_hit_answers_the_same(flags, placed):
    """Layers on the device (all, some, or all with the KV in host memory): the second request
    loads its prompt's blocks from the pool into the context and answers as the first,
    computed cold, did. Speculation is off by default there (its verifying steps round unlike
    single-token ones: on lavapipe a step of 9 or more rows takes another kernel)."""
    assert os.environ.get("GGML_VK_VISIBLE_DEVICES"), "make test-vulkan sets the device up"
    server = GatewayProcess(tiny_model("llama"), *flags, "--device", "Vulkan0",
                            "--parallel", "2", "--ctx-size", "1024", "--block-size", "16",
                            health_timeout=900)
    try:
        client = openai_client(server)
        first, second = (client.chat.completions.create(
            model=server.model_name, messages=CHAT, max_tokens=12, temperature=0)
            for _ in range(2))
        log = server.log_path.read_text()
        assert "llama.cpp backends: Vulkan, CPU" in log, log[-2000:]
        assert placed in log
        memory = allocated(server)
        assert memory[("Vulkan0", "model")] > 0
        assert (("Vulkan0", "KV") in memory) == ("--no-kv-offload" not in flags)
        assert "speculation off: on a GPU device" in log
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens >= 32  # two blocks of 16
        assert first.usage.completion_tokens == 12
        assert second.choices[0].message.content == first.choices[0].message.content
    finally:
        server.stop()


def completions(server: GatewayProcess, prompts: list[str], max_tokens: int,
                together: bool) -> list[str]:
    """Greedy completions of `prompts`, sent all at once or one by one; ignore_eos, so that each
    runs its whole length."""
    client = openai_client(server)

    def one(prompt: str) -> str:
        return client.completions.create(
            model=server.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text

    if not together:
        return [one(prompt) for prompt in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.gpu
def test_device_memory_is_reserved_at_start_so_full_sequences_never_run_out():
    """Layers and KV that cannot fit lavapipe's 2048 MiB are refused before loading, with the
    numbers. A worker that starts has all it needs on the device: every cell filled allocates
    nothing more, a prompt past a sequence's room is the API's 400, and
    the worker serves on."""
    with pytest.raises(RuntimeError, match=r"--n-gpu-layers all: 5 layers with their KV need "
                                           r"about \d+ MiB on Vulkan0, which has 2048 MiB "
                                           r"free: offload fewer layers"):
        GatewayProcess(tiny_model("llama"), *on_the_device("all"), "--parallel", "1",
                       "--ctx-size", "2000000", health_timeout=900)
    server = GatewayProcess(tiny_model("llama"), *on_the_device("all"), "--parallel", "2",
                            "--ctx-size", "256", "--block-size", "16", health_timeout=900)
    try:
        client = openai_client(server)
        before = allocated(server)

        def fill(topic: str):
            return client.completions.create(
                model=server.model_name, prompt=f"{RULES} The {topic}:", max_tokens=1000,
                temperature=0, extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(2) as pool:
            full = list(pool.map(fill, ["ferry", "tug"]))
        # A sequence may take every cell (one pool of 256 for both): two such do not fit side
        # by side, so one is preempted to the pool and resumed, and both run to the last cell.
        assert [(r.choices[0].finish_reason, r.usage.total_tokens) for r in full] == \
            [("length", 256)] * 2
        with pytest.raises(openai.BadRequestError) as refused:
            fill("barge " * 400)
        assert refused.value.code == "context_length_exceeded"
        assert allocated(server) == before
        assert fill("ferry").usage.total_tokens == 256  # serving on
    finally:
        server.stop()


@pytest.mark.gpu
@LAYERS
def test_requests_sharing_live_cells_on_the_device_and_preempted_answer_as_alone(layers):
    """Four requests at once on 128 cells: they share their common prefix's cells while it is
    live (seq_cp on the device), and do not fit side by side, so some are preempted (their
    blocks stored from the device into the pool) and resumed (loaded back). Each answers as it
    does alone on the uncached gateway."""
    servers = cached_and_uncached(tiny_model("llama"), *on_the_device(layers), "--parallel",
                                  "4", "--ctx-size", "128", "--block-size", "16")
    cached, uncached = next(servers)
    try:
        prompts = [f"{RULES} Question {i}: which ship comes next?" for i in range(4)]
        together = completions(cached, prompts, 40, together=True)
        alone = completions(uncached, prompts, 40, together=False)
        assert together == alone
        metrics = cached.settled()
        assert metrics["prefixgate_prefix_shared_tokens_total"] > 0
        assert metrics["prefixgate_num_preemptions_total"] > 0
        assert metrics["prefixgate_kv_cells_used"] == 0
        assert metrics["prefixgate_kv_pool_blocks_held"] == 0
    finally:
        next(servers, None)


@pytest.mark.gpu
def test_a_pinned_prefix_on_the_device_outlives_a_flood_and_answers_the_same():
    """Anthropic's cache_control pins a system prompt's blocks; a flood of other prompts
    through a 2 MiB pool (64 blocks of 16 tokens at 2 KiB a token) evicts every unpinned
    prefix, and the pinned one still loads onto the device and answers as it did cold."""
    server = GatewayProcess(tiny_model("llama"), *on_the_device("all"), "--parallel", "2",
                            "--ctx-size", "1024", "--block-size", "16", "--cache-mb", "2",
                            "--pin-budget-mb", "1", "--tenant-cache-share", "1",
                            "--temperature", "0", health_timeout=900)

    def ask(topic: str, pinned: bool) -> tuple[str, int]:
        system = {"type": "text", "text": f"{topic}: {RULES * 6}",
                  **({"cache_control": {"type": "ephemeral"}} if pinned else {})}
        r = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0
                                ).messages.create(
            model=server.model_name, max_tokens=8, system=[system],
            messages=[{"role": "user", "content": "Which ship came last?"}])
        return r.content[0].text, r.usage.cache_read_input_tokens

    try:
        cold, _ = ask("Lighthouse", pinned=True)
        ask("Ferry", pinned=False)
        for topic in ("Salt", "Nets", "Ice", "Gulls", "Rope", "Oars", "Tide"):
            ask(topic, pinned=False)
        assert ask("Ferry", pinned=False)[1] == 0  # evicted
        warm, read = ask("Lighthouse", pinned=True)
        assert read >= 96
        assert warm == cold
        assert server.settled()["prefixgate_kv_pool_blocks_held"] == 0
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.parametrize(("architecture", "layers"),
                         [("mamba", "all"), ("lfm2", "all"), ("lfm2", "2")])
def test_a_recurrent_state_kept_from_the_device_resumes_exactly(architecture, layers):
    """A recurrent (Mamba) and a hybrid (LFM2) model with every layer on the device: a prompt
    sharing another's prefix resumes from the state kept at its last block boundary, and its
    text and every top-3 logprob equal a cold prefill's on the same device."""
    servers = cached_and_uncached(tiny_model(architecture), *RECURRENT_ARGS,
                                  *on_the_device(layers))
    cached, uncached = next(servers)
    try:
        prefix = text(200, 1)
        complete(cached, prefix + " and then the first ending")
        warm = complete(cached, prefix + " but later a second ending")
        cold = complete(uncached, prefix + " but later a second ending")
        assert warm[2].prompt_tokens_details.cached_tokens > 0
        assert warm[:2] == cold[:2]
    finally:
        next(servers, None)


@pytest.mark.gpu
@LAYERS
def test_a_sliding_window_model_on_the_device_hits_past_its_window_and_chats_exactly(layers):
    """Gemma 3's shape (five of six layers see the last 32 positions) on the device: a prompt
    sharing a prefix three windows long continues with the text and top-5 tokens of a cold
    prefill; a chat's later turns read their history from the cache and answer as the uncached
    gateway does. The logprobs agree to 0.01 (on logits of ~180), not bit for bit as on the
    CPU: the device's kernels round a row by the size of its batch (the warm request computes
    8 rows, the cold one 180)."""
    servers = cached_and_uncached(tiny_model("gemma3"), *WINDOW_ARGS, *on_the_device(layers))
    cached, uncached = next(servers)
    try:
        system = rules(8)
        complete_top5(cached, system + "\nToday the keeper writes:")
        warm = complete_top5(cached, system + "\nAt dawn the keeper sees")
        cold = complete_top5(uncached, system + "\nAt dawn the keeper sees")
        assert warm[2].prompt_tokens_details.cached_tokens > 96  # past three windows
        assert warm[0] == cold[0]
        for hot, reference in zip(warm[1], cold[1], strict=True):
            assert hot.keys() == reference.keys()
            assert all(abs(hot[token] - reference[token]) < 0.01 for token in hot)
        history = [{"role": "system", "content": system}]
        for turn, question in enumerate(["Which ship came at hour 5?", "And then?"]):
            history.append({"role": "user", "content": question})
            warm, cold = chat(cached, history, 12), chat(uncached, history, 12)
            assert warm[0] == cold[0], f"turn {turn}"
            if turn:
                assert warm[2].prompt_tokens_details.cached_tokens > 96
            history.append({"role": "assistant", "content": warm[0]})
    finally:
        next(servers, None)


@pytest.mark.gpu
@LAYERS
def test_a_prefix_computed_on_one_gateways_device_loads_into_anothers_through_redis(redis_url,
                                                                                    layers):
    url, _ = redis_url
    args = (*on_the_device(layers), "--parallel", "2", "--ctx-size", "1024", "--block-size", "16",
            "--redis-url", url)
    first = GatewayProcess(tiny_model("llama"), *args, health_timeout=900)
    second = GatewayProcess(tiny_model("llama"), *args, health_timeout=900)
    try:
        cold = openai_client(first).chat.completions.create(
            model=first.model_name, messages=CHAT, max_tokens=12, temperature=0)
        wait_stored(first, cold.usage.prompt_tokens // 16)
        warm = openai_client(second).chat.completions.create(
            model=second.model_name, messages=CHAT, max_tokens=12, temperature=0)
        assert warm.usage.prompt_tokens_details.cached_tokens >= 32
        assert warm.choices[0].message.content == cold.choices[0].message.content
    finally:
        first.stop()
        second.stop()


@pytest.mark.gpu
@LAYERS
def test_a_restart_with_a_cache_dir_loads_its_prefixes_onto_the_device(tmp_path, layers):
    args = (*on_the_device(layers), "--parallel", "2", "--ctx-size", "1024", "--block-size", "16",
            "--cache-dir", str(tmp_path))

    def ask(server: GatewayProcess) -> tuple[str, int]:
        r = openai_client(server).chat.completions.create(
            model=server.model_name, messages=CHAT, max_tokens=12, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    (cold, cold_cached), (warm, warm_cached) = across_a_restart(tiny_model("llama"), args, ask)
    assert cold_cached == 0 and warm_cached >= 32
    assert warm == cold


@pytest.mark.gpu
def test_two_workers_take_a_device_each_and_share_the_pool():
    """lavapipe listed twice is two Vulkan devices: each of two workers loads every layer onto
    its own, and a prompt one computed on its device loads into the other's from the pool
    (round-robin routing sends the repeat to the other worker) and answers the same."""
    server = GatewayProcess(tiny_model("llama"), "--n-gpu-layers", "all", "--workers", "2",
                            "--routing", "round-robin", "--parallel", "2", "--ctx-size", "1024",
                            "--block-size", "16", env={"GGML_VK_VISIBLE_DEVICES": "0,0"},
                            health_timeout=900)
    try:
        wait_for_health(server, "ok", timeout=300)  # both workers: round-robin's order is known
        log = server.log_path.read_text()
        for worker, device in enumerate(["Vulkan0", "Vulkan1"]):
            assert re.search(rf"worker-{worker} .*5 layers on {device} \(worker {worker} of 2 "
                             r"on a device of its own; --n-gpu-layers all\)", log), log[-3000:]
        client = openai_client(server)
        first, second = (client.chat.completions.create(
            model=server.model_name, messages=CHAT, max_tokens=12, temperature=0)
            for _ in range(2))
        assert set(server.per_worker("prefixgate_routing_decisions_total").values()) == {1}
        assert second.usage.prompt_tokens_details.cached_tokens >= 32
        assert second.choices[0].message.content == first.choices[0].message.content
        assert server.settled()["prefixgate_kv_pool_blocks_held"] == 0
    finally:
        server.stop()


@pytest.mark.gpu
def test_a_worker_killed_mid_stream_on_the_device_leaks_nothing_and_is_replaced():
    """SIGKILL under a stream: the stream ends with an error event, a replacement worker loads
    the layers onto the device again and answers as before, and the pool holds no block and
    the cells no sequence of the killed request (the pool's consistency check passes)."""
    server = GatewayProcess(tiny_model("llama"), *on_the_device("all"), "--parallel", "2",
                            "--ctx-size", "1024", "--block-size", "16", health_timeout=900)
    try:
        client = openai_client(server)
        cold = client.chat.completions.create(model=server.model_name, messages=CHAT,
                                              max_tokens=12, temperature=0)
        victim = server.health()[1]["workers"][0]
        started, events = threading.Event(), []
        reader = threading.Thread(target=stream_events, args=(
            server, server.model_name, "Tell a very long story.", started, events))
        reader.start()
        assert started.wait(120)
        wait_running(server, "0", timeout=60)
        logged = len(server.log_path.read_text())
        os.kill(victim["pid"], signal.SIGKILL)
        reader.join(120)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_unavailable"
        replaced = wait_for_health(server, "ok", timeout=300)
        assert replaced["workers"][0]["pid"] != victim["pid"]
        warm = client.chat.completions.create(model=server.model_name, messages=CHAT,
                                              max_tokens=12, temperature=0)
        assert warm.choices[0].message.content == cold.choices[0].message.content
        metrics = server.settled()
        assert metrics["prefixgate_kv_pool_blocks_held"] == 0
        assert metrics["prefixgate_kv_cells_used"] == 0
        assert server.consistency()["ok"], server.consistency()
        assert "5 layers on Vulkan0" in server.log_path.read_text()[logged:]  # the replacement
    finally:
        server.stop()
