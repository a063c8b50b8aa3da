"""Streaming deltas (no server), the bench client and `impasto generate` against the model."""

from __future__ import annotations

import argparse
import subprocess
import sys

from impasto.engine import ipc
from impasto.engine.engine_client import _merge
from impasto.outputs import CompletionOutput, Logprob, RequestOutput


def test_to_wire_carries_the_delta_and_sorts_logprobs_by_rank():
    lps = [{7: Logprob(-2.0, 3, "x"), 5: Logprob(-0.1, 1, "y"), 6: Logprob(-1.0, 2, "z")}]
    c = CompletionOutput(0, "x", [7], cumulative_logprob=-2.0, logprobs=lps)
    d = ipc.to_wire(RequestOutput("r", None, [1, 2], [c], finished=False, num_cached_tokens=1))
    assert (d.request_id, d.finished, d.num_prompt_tokens, d.num_cached_tokens) == ("r", 0, 2, 1)
    (w,) = d.completions
    assert (w.text, w.token_ids, w.cumulative_logprob) == ("x", [7], -2.0)
    assert [e[0] for e in w.logprobs[0]] == [5, 6, 7]


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


def test_generate_completes_raw_text_without_a_chat_template(capsys):
    from impasto.entrypoints.cli import _raw_completion

    class Tok:
        chat_template = None

    assert _raw_completion(argparse.Namespace(raw=False), Tok())
    assert "no chat template" in capsys.readouterr().err
    Tok.chat_template = "{{ messages }}"
    assert not _raw_completion(argparse.Namespace(raw=False), Tok())
    assert _raw_completion(argparse.Namespace(raw=True), Tok())
