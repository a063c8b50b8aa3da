"""DiffusionGemma decoding: impasto against transformers' own `generate`, in the same run.

    python benchmarks/diffusion.py                      # canvas 256 and 64, steps 16 and 48
    python benchmarks/diffusion.py --canvas 64 --steps 16 --batch 1 4

Model: a random DiffusionGemma (4 layers: 3 sliding + 1 full, hidden 512, vocab 32k, 8
experts top-2 plus the dense MLP), fp32. Workload per row: `batch` prompts of 64 tokens,
one canvas each, EOS ignored, a fixed step cap (convergence disabled by a tiny confidence
threshold, so both engines run exactly `steps` denoising passes per canvas). impasto runs the
prompts as concurrent requests (max_num_seqs = batch); transformers as one padded batch.
Prints tokens/s, tokens per forward (committed tokens / denoising passes) and where impasto's
time goes: model forward (decoder passes, prefill and commit), LM head (+ soft-capping),
sampler, self-conditioning embeddings (softmax @ E), and the rest (scheduler, Python).

`--mixed N` adds a serving-shaped workload per (canvas, steps, batch): N requests that want
1 to 4 canvases each (drawn with seed 0), at most `batch` at a time. impasto gets them all at
once (max_num_seqs = batch: a finished request's slot is refilled at once); transformers runs
them in order, `batch` per `generate` call, each call generating the longest request's canvases
for all of its rows (its batch loop has one `max_new_tokens`). Tokens/s counts the tokens the
requests asked for, in both engines.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=2,
    sliding_window=512,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=256,
    max_position_embeddings=4096,
)
NEVER = 1e-9  # confidence threshold: no early convergence, exactly `steps` passes


def build(path: Path, canvas: int) -> Path:
    from transformers.models.diffusion_gemma import (
        DiffusionGemmaConfig,
        DiffusionGemmaForBlockDiffusion,
    )

    vision = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=8,
                  num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                  head_dim=8, position_embedding_size=4)  # fmt: skip
    cfg = DiffusionGemmaConfig(text_config=TEXT, vision_config=vision, canvas_length=canvas)
    cfg.architectures = ["DiffusionGemmaForBlockDiffusion"]
    torch.manual_seed(0)
    DiffusionGemmaForBlockDiffusion(cfg).float().save_pretrained(path)
    return path


class Timers:
    """Wall time of a few runner entry points (monkeypatched; nested calls counted once)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[label] += time.perf_counter() - t0

        setattr(obj, name, timed)


def run_impasto(
    path: Path,
    prompts,
    canvas: int,
    steps: int,
    timers: Timers | None,
    *,
    canvases: list[int] | None = None,
    concurrency: int | None = None,
):
    """`canvases[i]`: how many canvases request i wants (default 1 each)."""
    from impasto import LLM, SamplingParams

    concurrency = concurrency or len(prompts)
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        max_num_seqs=concurrency,
        max_num_batched_tokens=max(4096, canvas * concurrency),
        max_model_len=2048,
        diffusion_config={"max_denoising_steps": steps, "confidence_threshold": NEVER},
    )
    canvases = canvases or [1] * len(prompts)
    params = [SamplingParams(max_tokens=n * canvas, ignore_eos=True) for n in canvases]
    run = lambda ps, sp: llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)  # noqa: E731
    run(prompts[:1], params[0])  # warm-up (kernel selection for the shapes)
    runner = llm.llm_engine.runner
    if timers is not None:
        model = runner.model
        timers.wrap(runner, "execute_model", "step")
        timers.wrap(model, "forward", "forward")
        timers.wrap(model, "compute_logits", "lm_head")
        timers.wrap(model, "soft_embeddings", "self_cond")
        timers.wrap(runner.canvas_sampler, "step_many", "sampler")
    before = {m.name: m.value for m in llm.llm_engine.get_metrics()}
    t0 = time.perf_counter()
    outs = run(prompts, params)
    wall = time.perf_counter() - t0
    after = {m.name: m.value for m in llm.llm_engine.get_metrics()}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    passes = (
        after["impasto:diffusion_denoising_steps"] - before["impasto:diffusion_denoising_steps"]
    )
    return tokens, wall, tokens / passes


@torch.inference_mode()
def run_hf(
    path: Path,
    prompts,
    canvas: int,
    steps: int,
    *,
    canvases: list[int] | None = None,
    concurrency: int | None = None,
):
    """Batches of `concurrency` prompts in order, one `generate` call each."""
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    kw = dict(max_denoising_steps=steps, confidence_threshold=NEVER, eos_token_id=None)
    model.generate(torch.tensor(prompts[:1]), max_new_tokens=canvas, **kw)  # warm-up
    concurrency = concurrency or len(prompts)
    canvases = canvases or [1] * len(prompts)
    tpf = []
    t0 = time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        batch = torch.tensor(prompts[lo : lo + concurrency])
        longest = max(canvases[lo : lo + concurrency])
        out = model.generate(batch, max_new_tokens=longest * canvas, **kw)
        tpf.append(float(out.tokens_per_forward.float().mean()))
    wall = time.perf_counter() - t0
    tokens = canvas * sum(canvases)  # the tokens asked for (HF makes more for shorter rows)
    return tokens, wall, sum(tpf) / len(tpf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--canvas", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--steps", type=int, nargs="+", default=[16, 48])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--mixed",
        type=int,
        default=0,
        metavar="N",
        help="also run N requests of 1-4 canvases each, `batch` at a time",
    )
    ap.add_argument("--mixed-only", action="store_true", help="skip the fixed workload")
    # One thread by default: on a shared 2-core machine, 2-thread ops stall on their barrier
    # whenever another process holds a core (measured: rms_norm 72 us -> 46 ms).
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(
        "| workload | canvas | steps | batch | impasto tok/s | HF tok/s | impasto / HF | "
        "tok/forward (impasto, HF) | "
        "impasto time: forward / lm_head / sampler / self-cond / other |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for canvas in args.canvas:
            path = build(Path(tmp) / f"dg{canvas}", canvas)
            for steps in args.steps:
                for b in args.batch:
                    if not args.mixed_only:
                        prompts = torch.randint(3, 32000, (b, args.prompt_len), generator=gen)
                        row("fixed", path, prompts.tolist(), canvas, steps, b, None)
                    if args.mixed:
                        mix = torch.Generator().manual_seed(0)
                        prompts = torch.randint(
                            3, 32000, (args.mixed, args.prompt_len), generator=mix
                        )
                        canvases = torch.randint(1, 5, (args.mixed,), generator=mix).tolist()
                        row(
                            f"mixed {args.mixed}",
                            path,
                            prompts.tolist(),
                            canvas,
                            steps,
                            b,
                            canvases,
                        )


def row(label: str, path: Path, prompts, canvas: int, steps: int, b: int, canvases) -> None:
    timers = Timers()
    n_i, wall_i, tpf_i = run_impasto(
        path, prompts, canvas, steps, timers, canvases=canvases, concurrency=b
    )
    n_h, wall_h, tpf_h = run_hf(path, prompts, canvas, steps, canvases=canvases, concurrency=b)
    t = timers.t
    other = t["step"] - t["forward"] - t["lm_head"] - t["sampler"] - t["self_cond"]
    split = " / ".join(
        f"{100 * v / wall_i:.0f}%"
        for v in (
            t["forward"],
            t["lm_head"],
            t["sampler"],
            t["self_cond"],
            other + wall_i - t["step"],
        )
    )
    print(
        f"| {label} | {canvas} | {steps} | {b} | {n_i / wall_i:.1f} | {n_h / wall_h:.1f} | "
        f"{(n_i / wall_i) / (n_h / wall_h):.2f} | {tpf_i:.1f}, {tpf_h:.1f} | {split} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
