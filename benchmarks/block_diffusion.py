"""Masked block diffusion: impasto's engine against the reference loop and the upstream-style
transformers loop, same model, same rule and threshold, same run.

    python benchmarks/block_diffusion.py                       # tiny Qwen2 (token shift, B=8)
    python benchmarks/block_diffusion.py --model smollm2-135m-shakespeare-bd --max-tokens 64
    python benchmarks/block_diffusion.py --thresholds 0.7 0.9 0.95 --batch 4

For each threshold (rule `low_confidence`, greedy), `--batch` prompts are decoded
- by impasto: one `LLM.generate` call, the requests batched by the scheduler (float32, so the
  outputs can be compared token for token; and bf16, the engine's default on CPU);
- by the reference decoder (`impasto.testing.block_diffusion.reference_generate`: full-sequence
  forwards under the block-causal mask, no KV cache), one request at a time;
- by the upstream-style loop (`cached_generate`: SDAR's / Fast-dLLM v2's KV-cached loop on
  transformers, with the extra clean forward per block), one request at a time, as those
  generate functions run.
Printed: tokens/s (generated tokens / wall time), impasto's speedup over each loop, tokens
committed per forward (the parallelism diffusion buys: committed tokens / denoising forwards
per request, from impasto's metrics) and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "ACT I. SCENE I. Elsinore. A platform before the castle.\n",
    "HAMLET. To be, or not to be, that is the question:",
    "KING. Now, good my lord, what news from Denmark?",
    "OPHELIA. My lord, as I was sewing in my closet,",
    "MACBETH. So foul and fair a day I have not seen.",
    "JULIET. O Romeo, Romeo! wherefore art thou Romeo?",
    "PROSPERO. Now does my project gather to a head;",
    "LEAR. Blow, winds, and crack your cheeks! rage! blow!",
]


def prompts_for(path: Path, batch: int, tiny: bool) -> list[list[int]]:
    if tiny:
        return [[5 + (7 * i + j) % 150 for j in range(12 + 5 * i)] for i in range(batch)]
    from impasto.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    return [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(batch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a block-diffusion model (default: tiny)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.7, 0.9, 0.95])
    ap.add_argument("--num-threads", type=int, default=0)
    args = ap.parse_args()

    import torch

    from impasto.config.block_diffusion import BlockDiffusionConfig, UnmaskingParams
    from impasto.entrypoints.llm import LLM
    from impasto.loader.hf import read_hf_config
    from impasto.loader.packaged_models import resolve_model
    from impasto.sampling_params import SamplingParams
    from impasto.testing.block_diffusion import (
        build_block_checkpoint,
        cached_generate,
        load_reference_model,
        reference_generate,
    )

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tiny = args.model is None
    if tiny:
        path = build_block_checkpoint(Path(tempfile.mkdtemp()), "fast_dllm", 8, hidden_size=256,
                                      intermediate_size=512, num_hidden_layers=4)  # fmt: skip
    else:
        path = resolve_model(args.model)
    hf_cfg = read_hf_config(path)
    bcfg = BlockDiffusionConfig.resolve(None, hf_cfg, path)
    prompts = prompts_for(path, args.batch, tiny)
    model = load_reference_model(path)
    engines = {
        dtype: LLM(str(path), dtype=dtype, skip_tokenizer_init=True, max_model_len=512)
        for dtype in ("float32", "bfloat16")
    }
    threads = torch.get_num_threads()
    print(f"model {path.name}: block {bcfg.block_size}, token shift {bcfg.token_shift}, "
          f"batch {args.batch}, {args.max_tokens} tokens each, {threads} threads")  # fmt: skip
    header = ("threshold", "impasto f32", "impasto bf16", "reference", "upstream-style",
              "x ref", "x upstream", "tok/forward", "identical")  # fmt: skip
    print(" | ".join(f"{h:>13}" for h in header))
    for tau in args.thresholds:
        unmask = UnmaskingParams(algorithm="low_confidence", threshold=tau)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                extra_args={"threshold": tau})  # fmt: skip
        reqs = [{"prompt_token_ids": p} for p in prompts]
        rate, outs = {}, {}
        for dtype, llm in engines.items():
            before = {m.name: m.value for m in llm.get_metrics()}
            t0 = time.perf_counter()
            res = llm.generate(reqs, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            after = {m.name: m.value for m in llm.get_metrics()}
            outs[dtype] = [list(r.outputs[0].token_ids) for r in res]
            rate[dtype] = sum(map(len, outs[dtype])) / dt
            if dtype == "float32":
                steps = after["impasto:diffusion_denoising_steps"] - before.get(
                    "impasto:diffusion_denoising_steps", 0
                )
                committed = sum(map(len, outs[dtype]))
        kw = dict(block_size=bcfg.block_size, token_shift=bcfg.token_shift, params=unmask,
                  max_tokens=args.max_tokens, mask_token_id=bcfg.mask_token_id)  # fmt: skip
        for name, fn in (("reference", reference_generate), ("upstream", cached_generate)):
            t0 = time.perf_counter()
            outs[name] = [fn(model, p, **kw) for p in prompts]
            rate[name] = sum(map(len, outs[name])) / (time.perf_counter() - t0)
        same = outs["float32"] == outs["reference"] == outs["upstream"]
        row = (f"{tau}", f"{rate['float32']:.1f}", f"{rate['bfloat16']:.1f}",
               f"{rate['reference']:.1f}", f"{rate['upstream']:.1f}",
               f"{rate['float32'] / rate['reference']:.1f}x",
               f"{rate['float32'] / rate['upstream']:.1f}x", f"{committed / steps:.2f}",
               "yes" if same else "NO")  # fmt: skip
        print(" | ".join(f"{c:>13}" for c in row), flush=True)


if __name__ == "__main__":
    main()
