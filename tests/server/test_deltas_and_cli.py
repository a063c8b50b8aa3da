"""Streaming deltas (no server), the bench client and `impasto generate` against the model."""

from __future__ import annotations

import argparse
import subprocess
import sys

from impasto.engine import ipc
from impasto.engine.engine_client import _merge
from impasto.engine.engine_process import StreamState, held_back, make_delta
from impasto.outputs import CompletionOutput, RequestOutput


def _out(text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    c = CompletionOutput(0, text, ids, finish_reason=finish)
    return RequestOutput("r", None, [1, 2], [c], finished=finish is not None)


def test_held_back():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("abc", ["c", "bcd"]) == 2  # the longest proper prefix wins
    assert held_back("x", []) == 0


def test_make_delta_never_streams_a_partial_stop_string():
    st = StreamState(["STOP"], 1)
    d1 = make_delta(_out("ab S", [1, 2]), st)
    assert d1.completions[0].text == "ab " and d1.completions[0].token_ids == [1, 2]
    d2 = make_delta(_out("ab ST", [1, 2, 3]), st)
    assert d2.completions[0].text == "" and d2.completions[0].token_ids == [3]
    d3 = make_delta(_out("ab STx", [1, 2, 3, 4]), st)  # not a stop after all: released
    assert d3.completions[0].text == "STx"
    d4 = make_delta(_out("ab ", [1, 2, 3, 4, 5], "stop"), st)  # cut at the stop string
    assert d4.completions[0].finish_reason == "stop"
    assert make_delta(_out("ab ", [1, 2, 3, 4, 5], "stop"), st).completions == []


def test_make_delta_reassembles_text():
    st = StreamState([], 1)
    texts, full = [], "Hello, world!"
    for i in range(1, len(full) + 1):
        finish = "length" if i == len(full) else None
        texts += [
            c.text for c in make_delta(_out(full[:i], list(range(i)), finish), st).completions
        ]
    assert "".join(texts) == full


def test_merge_concatenates_deltas():
    a = ipc.RequestDelta("r", [ipc.CompletionDelta(0, "a", [1])], False, 3)
    b = ipc.RequestDelta("r", [ipc.CompletionDelta(0, "b", [2], finish_reason="stop")], True, 3)
    m = _merge(a, [b])
    assert m.finished and m.completions[0].text == "ab" and m.completions[0].token_ids == [1, 2]
    assert m.completions[0].finish_reason == "stop"


def test_bench_serve_against_server(server):
    import asyncio

    from impasto.bench.serve import add_cli_args, format_table, run_benchmark

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--base-url", server.url, "--api-key", server.api_key, "--num-prompts", "4",
         "--random-input-len", "16", "--random-output-len", "4", "--max-concurrency", "2",
         "--ignore-eos", "--num-warmups", "0"]
    )  # fmt: skip
    summary = asyncio.run(run_benchmark(args))
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 16
    assert summary["mean_ttft_ms"] > 0 and summary["p99_e2el_ms"] >= summary["median_e2el_ms"]
    assert "Output token throughput" in format_table(summary)


def test_generate_streams(tmp_path):
    cmd = [sys.executable, "-m", "impasto.entrypoints.cli", "generate", "Say hi.",
           "--max-tokens", "5", "--dtype", "float32", "--max-model-len", "256"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "### Say hi." in proc.stdout and "1 prompts" in proc.stdout
