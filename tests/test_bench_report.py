"""The benchmark report's target lines and tables, and the server set-ups it describes, from
synthetic results: no server runs here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench import FULL, level_layout, parse_args, settings_from, stream_layout, systems
from loadtest.gateway_process import ROOT
from loadtest.report import write_report
from loadtest.stats import RequestRecord, summarize


def run(system: str, workload: str, level: int, *, ttft: float = 1.0, wall: float = 10.0,
        throughput: float = 10.0, failed: int = 0, **extra) -> dict:
    figures = summarize([RequestRecord(start=0.0, chunk_times=[ttft, ttft + 0.1], end=ttft + 0.1,
                                       output_tokens=2, prompt_tokens=100)], wall)
    return {"system": system, "workload": workload, "concurrency": level, **figures,
            "wall_seconds": wall, "output_throughput": throughput, "failed": failed,
            "ttft_samples": [ttft], "per_turn": None, **extra}


def prefill(system: str, rate: float) -> dict:
    return run(system, "prefill", 1, prefill_tokens_per_s=rate, prefill_prompt_tokens=1040)


def per_system(system: str, *, prefill_rate: float, unique: float, shared_ttft: float,
               streams_wall: float, failed: int = 0) -> tuple[dict, list[dict], dict]:
    runs = [run(system, "unique", level, throughput=unique) for level in (1, 8)]
    runs += [run(system, "shared_prefix", 8, ttft=shared_ttft),
             run(system, "multi_turn", 8)]
    streams = run(system, "many_streams", 64, wall=streams_wall, failed=failed, kv_cells=7168,
                  peak_rss_bytes=2**30)
    return prefill(system, prefill_rate), runs, streams


def results(*systems_figures: tuple[str, dict]) -> dict:
    out = {"machine": {"platform": "Linux", "cpus": 2, "python": "3.11", "model": "m.gguf",
                       "threads": 2, "parallel": 8, "ctx_size": 4096, "output_tokens": 32},
           "workloads": "tiny", "streams_note": "Cells chosen so.", "systems": {},
           "runs": [], "prefill": [], "streams": []}
    for name, figures in systems_figures:
        first, runs, streams = per_system(name, **figures)
        out["systems"][name] = {"missing": None, "peak_rss_bytes": 2**30, "kv_cells": 32768}
        out["prefill"].append(first)
        out["runs"] += runs
        out["streams"].append(streams)
    return out


BASE = {"prefill_rate": 1000.0, "unique": 20.0, "shared_ttft": 10.0, "streams_wall": 100.0}
FIGURES = results(
    ("prefixgate", {"prefill_rate": 900.0, "unique": 21.0, "shared_ttft": 4.0,
                    "streams_wall": 15.0}),
    ("prefixgate-deterministic", {"prefill_rate": 960.0, "unique": 18.0, "shared_ttft": 6.0,
                                  "streams_wall": 10.0, "failed": 3}),
    ("llama-server", BASE),
)


def test_target_lines_cover_both_engine_modes_against_llama_server(tmp_path):
    table = write_report(FIGURES, tmp_path, plots=False)
    expected = [
        "- prefixgate vs llama-server, single-request prefill: 900.0 vs 1000.0 tok/s = 0.90x "
        "(target >= 1x): not met.",
        "- prefixgate vs llama-server, unique prompts, concurrency 1, output throughput: "
        "21.0 vs 20.0 tok/s = 1.05x (target >= 1x): met.",
        "- prefixgate vs llama-server, unique prompts, concurrency 8, throughput: "
        "21.0 vs 20.0 tok/s = 1.05x (target >= 1x): met.",
        "- prefixgate vs llama-server, shared prefix, concurrency 8, TTFT p50: "
        "4.000 vs 10.000 s = 0.40x (target <= 0.5x): met.",
        "- prefixgate vs llama-server, 64 streams, wall time: 15.000 vs 100.000 s = 0.15x "
        "(target <= 0.1x): not met.",
        "- prefixgate-deterministic vs llama-server, single-request prefill: 960.0 vs 1000.0 "
        "tok/s = 0.96x (target >= 1x): not met.",
        "- prefixgate vs llama-server, multi-turn, concurrency 8, TTFT p50: 1.000 vs 1.000 s "
        "= 1.00x (target <= 0.6x): not met.",
        "- prefixgate vs llama-server, peak memory: 1024 vs 1024 MiB = 1.00x (target <= 1x): "
        "met.",
        "- prefixgate-deterministic vs llama-server, shared prefix, concurrency 8, TTFT p50: "
        "6.000 vs 10.000 s = 0.60x (target <= 0.5x): not met.",
    ]
    for line in expected:
        assert line in table.splitlines()
    assert (tmp_path / "benchmarks.md").read_text() == table


def test_a_run_with_failed_requests_misses_its_target(tmp_path):
    table = write_report(FIGURES, tmp_path, plots=False)
    assert ("- prefixgate-deterministic vs llama-server, 64 streams, wall time: 10.000 vs "
            "100.000 s = 0.10x (target <= 0.1x): not met; 3 of prefixgate-deterministic's "
            "requests failed.") in table.splitlines()


def test_targets_without_a_baseline_run_say_not_measured(tmp_path):
    figures = json.loads(json.dumps(FIGURES))
    figures["prefill"] = [r for r in figures["prefill"] if r["system"] != "llama-server"]
    table = write_report(figures, tmp_path, plots=False)
    assert ("- prefixgate vs llama-server, single-request prefill: not measured "
            "(target >= 1x).") in table.splitlines()


def test_other_systems_are_compared_without_targets(tmp_path):
    table = write_report(FIGURES, tmp_path, plots=False)
    assert ("- prefixgate vs prefixgate-deterministic, 64 streams, wall time: 15.000 vs 10.000 s "
            "= 1.50x; 3 of prefixgate-deterministic's requests failed.") in table.splitlines()


def table_rows(table: str, heading: str) -> list[list[str]]:
    section = table.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| ") and "---" not in line]


def test_prefill_table_gives_the_ratio_to_llama_server(tmp_path):
    table = write_report(FIGURES, tmp_path, plots=False)
    assert "target >= 1x llama-server's" in table
    rows = table_rows(table, "Single-request prefill")
    assert rows[1] == ["prefixgate", "1040", "1.000", "900.0", "0.90x", "0"]
    assert rows[3][:5] == ["llama-server", "1040", "1.000", "1000.0", "1.00x"]


def test_streams_table_reports_wall_ratio_failures_and_systems_that_did_not_start(tmp_path):
    figures = json.loads(json.dumps(FIGURES))
    figures["streams"].append({"system": "prefixgate-no-cache", "workload": "many_streams",
                               "concurrency": 64, "kv_cells": 38400,
                               "missing": "could not start: exited | status 1:\nlog line\n"})
    table = write_report(figures, tmp_path, plots=False)
    assert "Cells chosen so." in table
    rows = {row[1]: row for row in table_rows(table, "Many streams")[1:]}
    assert rows["prefixgate"] == ["64", "prefixgate", "7168", "15.0", "0.15x", "1.000", "10.0",
                                  "1024", "0"]
    assert rows["prefixgate-deterministic"][-1] == "3"
    assert rows["prefixgate-no-cache"][3] == \
        "not run: could not start: exited \\| status 1: log line"
    assert len(rows["prefixgate-no-cache"]) == 9
    # The many-streams and prefill runs are in the table of all runs too.
    assert "| many streams | 64 | prefixgate |" in table
    assert "| prefill | 1 | llama-server |" in table


def test_plots_take_only_the_per_level_workloads(tmp_path):
    table = write_report(FIGURES, tmp_path, plots=True)
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "ttft_shared_prefix.png").stat().st_size > 0
    assert "![Output throughput against concurrency](throughput.png)" in table


def test_saved_results_from_before_prefill_and_streams_still_report(tmp_path):
    old = json.loads(json.dumps(FIGURES))
    for key in ("prefill", "streams", "streams_note", "workloads"):
        del old[key]
    for info in old["systems"].values():
        del info["kv_cells"]
    saved = tmp_path / "bench-old.json"
    saved.write_text(json.dumps(old))
    subprocess.run([sys.executable, "-m", "loadtest.report", str(saved), "--out",
                    str(tmp_path / "out")], cwd=ROOT, check=True, timeout=120,
                   capture_output=True)
    table = (tmp_path / "out" / "benchmarks.md").read_text()
    assert "single-request prefill: not measured" in table
    assert "## Many streams" not in table and "## Single-request prefill" not in table
    assert "unique prompts, concurrency 1, output throughput: 21.0 vs 20.0" in table


def command_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_ctx_size_is_total_cells_and_the_deterministic_mode_is_a_system():
    settings = settings_from(parse_args(["--model", "m.gguf", "--parallel", "8",
                                         "--ctx-size", "4096"]))
    servers = systems(settings, Path("/nonexistent/llama-server"), [2], level_layout(settings))
    for name in ("prefixgate", "prefixgate-no-cache", "prefixgate-deterministic"):
        assert command_value(servers[name].command, "--ctx-size") == str(8 * 4096)
    assert "--deterministic" in servers["prefixgate-deterministic"].command
    assert command_value(servers["llama-server"].command, "-c") == str(8 * 4096)
    assert command_value(servers["llama-cpp-python"].command, "--n_ctx") == "4096"
    assert servers["llama-server"].missing
    assert list(servers) == parse_args([]).systems  # every system, by default


def test_many_streams_cells_share_the_prompt_only_in_prefixgate():
    layout = stream_layout(FULL, output_tokens=32, n=128)
    settings = settings_from(parse_args(["--model", "m.gguf"]))
    servers = systems(settings, Path("/nonexistent"), [2], layout)
    prefixgate = int(command_value(servers["prefixgate"].command, "--ctx-size"))
    # Room for the prompt once and every stream's own tokens, not a copy of it per stream.
    assert 400 + 128 * (16 + 32) < prefixgate < 128 * 400
    assert command_value(servers["prefixgate"].command, "--parallel") == "128"
    for name, flag in (("prefixgate-deterministic", "--ctx-size"), ("llama-server", "-c")):
        # Each stream its own copy: the deterministic mode splits the cells evenly.
        assert int(command_value(servers[name].command, flag)) >= 128 * 600
    assert stream_layout(FULL, output_tokens=32, n=4).shared_cells == 4096  # the floor


@pytest.mark.parametrize(("argv", "streams"), [
    ([], [64, 128]), (["--streams"], []), (["--no-streams"], []), (["--streams", "32"], [32]),
    (["--smoke"], [4]), (["--smoke", "--no-streams"], []),
])
def test_stream_levels_from_the_command_line(argv, streams):
    assert settings_from(parse_args(["--model", "m.gguf", *argv])).streams == streams


def test_structured_output_throughput_is_compared_per_request(tmp_path):
    # Fewer tokens a second from prefixgate, more records: llama-server's JSON spreads over
    # more tokens. The target counts records.
    figures = json.loads(json.dumps(FIGURES))
    for system, (tokens, records) in {"prefixgate": (30.0, 0.6),
                                      "llama-server": (38.0, 0.5)}.items():
        figures["runs"].append(run(system, "structured", 4, throughput=tokens,
                                   request_throughput=records))
    table = write_report(figures, tmp_path, plots=False).splitlines()
    assert ("- prefixgate vs llama-server, structured output, concurrency 4, throughput: "
            "0.600 vs 0.500 req/s = 1.20x (target >= 1x): met.") in table


def test_requests_scale_multiplies_every_per_level_workload():
    settings = settings_from(parse_args(["--model", "m.gguf", "--requests-scale", "3"]))
    scaled = FULL.scaled(settings.requests_scale)
    assert (scaled.groups, scaled.conversations, scaled.unique_prompts,
            scaled.structured_prompts) == (6, 12, 48, 24)
    assert (scaled.prefix_tokens, scaled.turns, scaled.unique_tokens) == (
        FULL.prefix_tokens, FULL.turns, FULL.unique_tokens)  # the same requests, more of them
    assert "unique = 48 prompts" in scaled.describe()
