"""The real lm-evaluation-harness client (`lm_eval --model local-completions`) against a live
server, and `lm_eval --model hf` on the same checkpoint (tiny random Llama, byte tokenizer,
fp32), on a small local loglikelihood task and a generate_until task: per-item
log-likelihoods within 1e-3 of each other, and the same greedy generations. The loglikelihood
requests are `echo` + `logprobs` + `max_tokens: 0` completions over token ids."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from impasto.testing import save_byte_tokenizer
from tests.entrypoints.conftest import build_checkpoint

from .conftest import start_server

pytestmark = pytest.mark.slow

DOCS = [
    {"context": "The cat sat on the", "continuation": " mat"},
    {"context": "One, two, three,", "continuation": " four"},
    {"context": "Shall I compare thee", "continuation": " to a summer's day?"},
    {"context": "To be, or not to be:", "continuation": " that is the question"},
]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
"""
GEN = """generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _lm_eval(tmp, out: str, model: str, model_args: str) -> dict[str, list]:
    env = dict(
        os.environ,
        HF_DATASETS_CACHE=str(tmp / "hf-datasets"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
        "--tasks", "impasto_ll,impasto_gen", "--include_path", str(tmp / "tasks"),
        "--log_samples", "--output_path", str(tmp / out), "--device", "cpu",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = {}
    for task in ("ll", "gen"):
        (path,) = glob.glob(str(tmp / out / "*" / f"samples_impasto_{task}_*.jsonl"))
        rows = sorted((json.loads(line) for line in open(path)), key=lambda r: r["doc_id"])
        samples[task] = [r["resps"][0][0] for r in rows]
    return samples


def test_lm_eval_local_completions_equals_hf(tmp_path):
    model = build_checkpoint(
        tmp_path / "model", "llama", vocab_size=272, eos_token_id=256, max_position_embeddings=512
    )
    save_byte_tokenizer(model)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "ll.yaml").write_text(
        TASK.format(name="impasto_ll", data=data, kind="loglikelihood")
        + "metric_list:\n  - metric: acc\n"
    )
    (tasks / "gen.yaml").write_text(
        TASK.format(name="impasto_gen", data=data, kind="generate_until") + GEN
    )
    flags = ["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "512"]
    srv = start_server(tmp_path, api_key=None, extra=flags)
    try:
        api = _lm_eval(
            tmp_path,
            "out-api",
            "local-completions",
            f"model=tiny,base_url={srv.url}/v1/completions,tokenizer={model},"
            "num_concurrent=1,max_retries=1",
        )
    finally:
        srv.stop()
    hf = _lm_eval(tmp_path, "out-hf", "hf", f"pretrained={model},dtype=float32")
    for (lp_api, greedy_api), (lp_hf, greedy_hf) in zip(api["ll"], hf["ll"], strict=True):
        assert float(lp_api) == pytest.approx(float(lp_hf), abs=1e-3)
        assert greedy_api == greedy_hf
    assert api["gen"] == hf["gen"]
