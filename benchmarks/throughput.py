"""Offline throughput and batch-1 decode: impasto vs HF transformers (and peers) in one run.

    python benchmarks/throughput.py                # impasto + HF, SmolLM2-135M in bf16
    IMPASTO_BENCH_VLLM_PYTHON=/path/to/python \\
    IMPASTO_BENCH_LLAMACPP_PYTHON=/path/to/python IMPASTO_BENCH_LLAMACPP_GGUF=model-bf16.gguf \\
    python benchmarks/throughput.py                # + vLLM-CPU and llama.cpp, same token ids

Workloads (same prompt token ids for every engine): "offline" = 64 prompts with lengths uniform
in [32, 512], 128 new tokens each, EOS ignored, seed 0; "batch1" = one 32-token prompt, 128
new tokens. Prints tokens/s (generated tokens / wall time), the ratio to impasto, and CPU/wall
(about 2.0 means both cores were ours: the machine is shared, rerun when it is not).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


@dataclass
class Result:
    engine: str
    workload: str
    tokens: int
    wall_s: float
    cpu_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def make_workloads(vocab: int, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_len, args.max_len + 1, size=args.num_prompts)
    offline = [rng.integers(100, vocab, size=n).tolist() for n in lens]
    batch1 = [rng.integers(100, vocab, size=32).tolist()]
    return {"offline": offline, "batch1": batch1}


def _cpu() -> float:
    self_ = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


def run_impasto(model: Path, dtype: str, workloads, new_tokens: int) -> list[Result]:
    from impasto import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, max_model_len=1024, max_num_seqs=64, seed=0)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": workloads["batch1"][0][:8]}], params, use_tqdm=False)
    results = []
    for name, prompts in workloads.items():
        t0, c0 = time.perf_counter(), _cpu()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results.append(Result("impasto", name, tokens, wall, cpu))
    return results


def run_hf(model: Path, dtype: str, workloads, new_tokens: int) -> list[Result]:
    import torch
    from transformers import LlamaForCausalLM

    from impasto.loader.gguf_loader import gguf_to_hf_config, load_gguf_state_dict

    torch_dtype = getattr(torch, dtype)
    hf = LlamaForCausalLM(gguf_to_hf_config(model)).to(torch_dtype).eval()
    hf.load_state_dict(load_gguf_state_dict(model, torch_dtype), strict=False)
    hf.tie_weights()
    results = []
    for name, prompts in workloads.items():
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        t0, c0 = time.perf_counter(), _cpu()
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        tokens = (out.shape[1] - width) * len(prompts)
        results.append(Result("hf-transformers", name, tokens, wall, cpu))
    return results


def run_peer(
    engine: str, python: str, script: str, model: str, dtype: str, workloads, new_tokens: int
) -> list[Result]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {"model": model, "dtype": dtype, "workloads": workloads, "new_tokens": new_tokens}, f
        )
    proc = subprocess.run(
        [python, str(HERE / "peers" / script), f.name], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        print(f"# {engine} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return []
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [Result(engine, r["workload"], r["tokens"], r["wall_s"], r["cpu_s"]) for r in rows]


def export_hf_folder(model: Path, dtype: str) -> Path:
    """vLLM reads HF folders: write the dequantized weights and the tokenizer once."""
    out = Path(tempfile.gettempdir()) / f"impasto-bench-{model.stem}-{dtype}"
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file

    from impasto.loader.gguf_loader import gguf_to_hf_config, load_gguf_state_dict
    from impasto.loader.tokenizer import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = gguf_to_hf_config(model)
    config.torch_dtype = dtype
    config.save_pretrained(out)
    state = load_gguf_state_dict(model, getattr(torch, dtype))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    load_tokenizer(model).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--only", choices=["offline", "batch1"], default=None)
    args = parser.parse_args()

    from impasto.loader.gguf_loader import gguf_to_hf_config
    from impasto.loader.packaged_models import resolve_model

    model = resolve_model(args.model)
    workloads = make_workloads(gguf_to_hf_config(model).vocab_size, args)
    if args.only:
        workloads = {args.only: workloads[args.only]}
    results = run_impasto(model, args.dtype, workloads, args.new_tokens)
    if not args.skip_hf:
        results += run_hf(model, args.dtype, workloads, args.new_tokens)
    if os.environ.get("IMPASTO_BENCH_VLLM_PYTHON"):
        folder = export_hf_folder(model, args.dtype)
        results += run_peer(
            "vllm-cpu",
            os.environ["IMPASTO_BENCH_VLLM_PYTHON"],
            "vllm_peer.py",
            str(folder),
            args.dtype,
            workloads,
            args.new_tokens,
        )
    if os.environ.get("IMPASTO_BENCH_LLAMACPP_PYTHON") and os.environ.get(
        "IMPASTO_BENCH_LLAMACPP_GGUF"
    ):
        results += run_peer(
            "llama.cpp",
            os.environ["IMPASTO_BENCH_LLAMACPP_PYTHON"],
            "llamacpp_peer.py",
            os.environ["IMPASTO_BENCH_LLAMACPP_GGUF"],
            args.dtype,
            workloads,
            args.new_tokens,
        )

    base = {r.workload: r.tok_s for r in results if r.engine == "impasto"}
    print(f"\nmodel {model.name}, {args.dtype}, torch threads {os.cpu_count()}")
    print(
        f"{'engine':<16} {'workload':<8} {'tokens':>7} {'wall s':>8} {'tok/s':>8} "
        f"{'impasto/x':>9} {'cpu/wall':>8}"
    )
    for r in results:
        ratio = base[r.workload] / r.tok_s if r.tok_s else float("nan")
        print(
            f"{r.engine:<16} {r.workload:<8} {r.tokens:>7} {r.wall_s:>8.2f} {r.tok_s:>8.1f} "
            f"{ratio:>9.2f} {r.cpu_s / r.wall_s:>8.2f}"
        )


if __name__ == "__main__":
    main()
