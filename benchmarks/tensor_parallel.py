"""Tensor parallelism on this machine: TP=2 against TP=1, same run, same weights, and the time
the ranks spend in collectives (all-reduce after each row-parallel layer, all-gather of the
logits).

    python benchmarks/tensor_parallel.py [--model smollm2-135m-instruct] [--batch 1 8]

Each configuration is a fresh in-process `LLMEngine` (TP ranks are its worker processes), all
of them on the machine's cores (TP=N: cores / N threads per rank). Sharded weights are dense
(a packed GGUF tensor is dequantized when it is split), so the fair baseline is TP=1 on the
same dense weights (`quantization="none"`); TP=1 on the packed file is printed too. Decode
tok/s is measured over `--tokens` greedy tokens per request after a warm-up, EOS ignored.
Collective time is rank 0's wall time inside all-reduce / all-gather, per engine step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from impasto import SamplingParams  # noqa: E402
from impasto.config import EngineArgs  # noqa: E402
from impasto.engine.engine import LLMEngine  # noqa: E402
from impasto.models.layers.parallel import collective_stats  # noqa: E402

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 339, 1638, 2210, 288, 803, 30, 2]


def run(model: str, tp: int, quantization: str | None, batch: int, tokens: int) -> dict:
    engine = LLMEngine(
        EngineArgs(
            model=model,
            tensor_parallel_size=tp,
            quantization=quantization,
            skip_tokenizer_init=True,
            max_model_len=512,
            max_num_seqs=max(batch, 1),
        )
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

        def one_round(prefix: str) -> tuple[float, int, int]:
            for i in range(batch):
                engine.add_request(f"{prefix}{i}", {"prompt_token_ids": PROMPT + [i]}, params)
            while engine.has_unfinished_requests():  # prefill + first token
                engine.step()
                if all(len(r.output_token_ids) > 0 for r in engine.scheduler.running):
                    break
            steps, start = 0, time.perf_counter()
            before = collective_stats()
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            after = collective_stats()
            elapsed = time.perf_counter() - start
            coll = after["seconds"] - before["seconds"], after["count"] - before["count"]
            return elapsed, steps, coll

        one_round("warm")
        elapsed, steps, (coll_s, coll_n) = one_round("r")
        decoded = batch * (tokens - 1)
        return {
            "tok_s": decoded / elapsed,
            "step_ms": 1e3 * elapsed / max(steps, 1),
            "coll_ms": 1e3 * coll_s / max(steps, 1),
            "coll_per_step": coll_n / max(steps, 1),
        }
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    configs = [("TP=1 packed", 1, None), ("TP=1 dense", 1, "none"), ("TP=2 dense", 2, "none")]
    print(f"model {a.model}, {a.tokens} greedy tokens per request, bf16 activations")
    print(f"{'config':<14}{'batch':>6}{'tok/s':>9}{'vs TP=1 dense':>15}{'ms/step':>9}"
          f"{'collective ms/step':>20}{'collectives/step':>18}")  # fmt: skip
    for batch in a.batch:
        results = {name: run(a.model, tp, q, batch, a.tokens) for name, tp, q in configs}
        base = results["TP=1 dense"]["tok_s"]
        for name, r in results.items():
            ratio = r["tok_s"] / base
            print(f"{name:<14}{batch:>6}{r['tok_s']:>9.1f}{ratio:>14.2f}x{r['step_ms']:>9.1f}"
                  f"{r['coll_ms']:>20.2f}{r['coll_per_step']:>18.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
