"""Benchmark prompts: reproducible random text of a target length, or a corpus file.

Random prompts are built from common English words (most are one token, with their leading
space, in BPE vocabularies), so no tokenizer is needed on the client: the exact prompt token
counts come back in each response's `usage`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "or has had first one their its new after who they have her she two been other when there "
    "all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "team film under while since part well being people war four early three people work house "
    "game water light color paint river small large green blue red long short north south east "
    "west music story before again number place great year old same life day way home hand"
).split()


@dataclass
class BenchRequest:
    prompt: str
    max_tokens: int


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - r), len * (1 + r)]; each prompt starts differently (a
    distinct index) so the prefix cache cannot serve one request from another."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        n_in = max(
            1, rng.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)))
        )
        n_out = max(
            1, rng.randint(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio)))
        )
        words = [str(seed * 100003 + i)] + [rng.choice(_WORDS) for _ in range(n_in - 1)]
        out.append(BenchRequest(" ".join(words), n_out))
    return out


def prefix_repetition_requests(
    num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """`num_prefixes` shared prefixes of `prefix_len` words (a system prompt each), each request
    one of them followed by its own `suffix_len` words (a question), in shuffled order: the
    shared-prefix load that prefix caching and prefix-aware routing are for (vLLM's
    `prefix_repetition` dataset, in spirit)."""
    rng = random.Random(seed)
    prefixes = [
        " ".join([f"system-{seed}-{p}:"] + [rng.choice(_WORDS) for _ in range(prefix_len - 1)])
        for p in range(num_prefixes)
    ]
    out = []
    for i in range(num):
        question = " ".join([str(i)] + [rng.choice(_WORDS) for _ in range(suffix_len - 1)])
        out.append(BenchRequest(f"{prefixes[i % num_prefixes]} {question}", output_len))
    rng.shuffle(out)
    return out


def corpus_requests(path: str, num: int, output_len: int, seed: int) -> list[BenchRequest]:
    """A JSONL file of {"prompt": ...} (or {"text": ...}) records, or a plain text file with one
    prompt per line; sampled with replacement when `num` exceeds the file."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    prompts = []
    for ln in lines:
        if ln.lstrip().startswith("{"):
            rec = json.loads(ln)
            prompts.append(str(rec.get("prompt") or rec.get("text") or ""))
        else:
            prompts.append(ln)
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    rng = random.Random(seed)
    picked = prompts[:num] if num <= len(prompts) else [rng.choice(prompts) for _ in range(num)]
    return [BenchRequest(p, output_len) for p in picked]
