"""The `impasto` command: generate, download (serve and bench come with the server)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kw: dict = {"dtype": args.dtype, "seed": args.seed, "max_num_seqs": args.max_num_seqs}
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.num_gpu_blocks_override:
        kw["num_gpu_blocks_override"] = args.num_gpu_blocks_override
    if args.speculative_config:
        kw["speculative_config"] = json.loads(args.speculative_config)
    return kw


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--speculative-config", default=None, help="JSON")


def cmd_generate(args: argparse.Namespace) -> int:
    from impasto.entrypoints.llm import LLM
    from impasto.sampling_params import SamplingParams

    prompts = args.prompts or ["Write a haiku about paint."]
    llm = LLM(args.model, **_engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed
    )
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        total += len(completion.token_ids)
        print(f"### {prompt}\n{completion.text.strip()}\n")
    print(f"{len(prompts)} prompts, {total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tok/s")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from impasto.loader.default_model import ensure_default_model

    print(ensure_default_model())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="impasto", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    _add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)
    dl = sub.add_parser("download", help="fetch the default model into the cache")
    dl.set_defaults(func=cmd_download)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
