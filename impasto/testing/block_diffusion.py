"""Masked block diffusion for tests and benchmarks: tiny checkpoints and two plain decoders.

- `build_block_checkpoint`: a tiny random Qwen3 / Qwen2 / Llama body saved as an SDAR,
  Fast-dLLM v2 or impasto block-diffusion HF folder (config.json as those checkpoints spell it);
- `reference_generate`: the decoder as the papers and upstream code describe it, written plainly:
  one request, no KV cache, every step a full-sequence transformers forward under the explicit
  block-causal mask. The engine must produce exactly its tokens;
- `cached_generate`: the upstream-style loop (SDAR's `block_diffusion_generate`, Fast-dLLM v2's
  `batch_sample`): whole prompt blocks prefilled into transformers' KV cache, each denoising step
  a forward of the block against the cache (cropped back after it), one clean forward to store a
  finished block. The benchmarks' baseline; it must agree with `reference_generate`.

Decoding rules (shared by both, and by the engine): blocks sit at absolute positions 0, B, 2B..;
the prompt's tail leads its block, the rest of it is masks; per step, each masked slot gets a
candidate (greedy argmax, or a draw from the tempered, top-k/top-p filtered distribution by
inverse CDF at the uniform `uniform(seed, position, step)`) and a confidence (its probability
under the tempered distribution); the mask token is never a candidate; the rule commits
(low_confidence: conf > threshold else the best; top_k: the k best; entropy_bounded: lowest
entropies while sum - max <= bound, at least one; random: k uniformly ranked); ties go to the
leftmost slot; at the step cap everything left is committed. With token shift slot j reads
position j - 1 and the block's first step always commits slot 0 (the AR next token).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from impasto.config.block_diffusion import UnmaskingParams
from impasto.worker.block_diffusion.unmasking import STREAM_CANDIDATE, STREAM_RANDOM_ORDER, uniform
from impasto.worker.sampling_ops import apply_top_k_top_p

MASK_TOKEN_ID = 3  # the tiny checkpoints' mask token (not bos/eos/pad)
DEFAULT_PARAMS = UnmaskingParams()

_FLAVOURS = {
    # flavour: (body model_type, architectures, model_type written, block-size key, token shift)
    "sdar": ("qwen3", "SDARForCausalLM", "sdar", "block_size", False),
    "fast_dllm": ("qwen2", "Fast_dLLM_QwenForCausalLM", "Fast_dLLM_Qwen", "bd_size", True),
    "llama": (
        "llama",
        "BlockDiffusionLlamaForCausalLM",
        "block_diffusion_llama",
        "block_size",
        True,
    ),
}


def build_block_checkpoint(
    path: Path,
    flavour: str,
    block_size: int,
    *,
    token_shift: bool | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A tiny random checkpoint of `flavour` ("sdar": Qwen3 body, no shift; "fast_dllm": Qwen2
    body, token shift; "llama": impasto's own Llama adaptation) with weights peaked enough
    (transformers' init x 3) for sharp, non-degenerate confidences."""
    from transformers import AutoConfig, AutoModelForCausalLM

    body, arch, model_type, key, shift = _FLAVOURS[flavour]
    tiny: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=160,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if body == "qwen3":
        tiny["head_dim"] = 16
    torch.manual_seed(seed)
    config = AutoConfig.for_model(body, **{**tiny, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data.update(architectures=[arch], model_type=model_type, mask_token_id=MASK_TOKEN_ID)
    data[key] = block_size
    data["token_shift"] = shift if token_shift is None else token_shift
    (path / "config.json").write_text(json.dumps(data, indent=2))
    return path


def load_reference_model(path: Path) -> torch.nn.Module:
    """The checkpoint as its transformers body (eager attention: exact 4D masks)."""
    from transformers import AutoModelForCausalLM

    from impasto.loader.hf import read_hf_config

    config = read_hf_config(path)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, local_files_only=True
    ).eval()


def block_causal_mask(q_start: int, length: int, block: int) -> torch.Tensor:
    """[1, 1, length - q_start, length] additive mask: query i sees key j iff j // B <= i // B."""
    q = torch.arange(q_start, length)[:, None] // block
    k = torch.arange(length)[None, :] // block
    return torch.where(k <= q, 0.0, float("-inf"))[None, None]


def _candidates(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int,
    positions: list[int], step: int,
) -> tuple[list[int], list[float], list[float]]:  # fmt: skip
    """Per slot: candidate token, confidence, entropy (plainly, one slot at a time)."""
    tokens, confs, ents = [], [], []
    for row, pos in zip(logits, positions, strict=True):
        t = 1.0 if temperature < 1e-5 else temperature
        probs = torch.softmax(row / t, dim=-1)
        logp = torch.log_softmax(row / t, dim=-1)
        ents.append(float(-(probs * logp).nan_to_num(0.0).sum()))
        if temperature < 1e-5:
            tok = int(torch.argmax(probs))  # the first maximum
        else:
            k = torch.tensor([top_k]) if top_k > 0 else None
            p = torch.tensor([top_p]) if top_p < 1.0 else None
            filtered = torch.softmax(apply_top_k_top_p((row / t)[None], k, p)[0], dim=-1)
            cdf = torch.cumsum(filtered, dim=0)
            target = uniform(seed, pos, step, STREAM_CANDIDATE) * float(cdf[-1])
            tok = min(int((cdf <= target).sum()), row.numel() - 1)
        tokens.append(tok)
        confs.append(float(probs[tok]))
    return tokens, confs, ents


def _rank(scores: list[float], k: int) -> list[int]:
    """Indices of the k highest scores, ties to the leftmost."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


def _choose(
    p: UnmaskingParams, confs: list[float], ents: list[float], seed: int, positions: list[int],
    step: int,
) -> set[int]:  # fmt: skip
    if p.algorithm == "low_confidence":
        keep = {i for i, c in enumerate(confs) if c > p.threshold}
        return keep or set(_rank(confs, 1))
    if p.algorithm == "top_k":
        return set(_rank(confs, p.k_per_step))
    if p.algorithm == "entropy_bounded":
        order = sorted(range(len(ents)), key=lambda i: (ents[i], i))
        keep, total = set(), 0.0
        for i in order:
            total += ents[i]
            if total - ents[i] > p.entropy_bound:  # the sum of the others exceeds the bound
                break
            keep.add(i)
        return keep or {order[0]}
    scores = [uniform(seed, q, step, STREAM_RANDOM_ORDER) for q in positions]
    return set(_rank(scores, p.k_per_step))


@dataclass(frozen=True)
class _Rule:
    """How one request's blocks are unmasked (both loops)."""

    params: UnmaskingParams
    cap: int  # steps per block
    token_shift: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    mask_token_id: int


def _unmask(
    rows: torch.Tensor, slots: list[int], block: list[int], masked: list[bool], start: int,
    step: int, rule: _Rule,
) -> None:  # fmt: skip
    """One step on a block, in place: `rows` [m, V] are the logits of its masked `slots`."""
    rows[:, rule.mask_token_id] = float("-inf")
    positions = [start + s for s in slots]
    toks, confs, ents = _candidates(
        rows, rule.temperature, rule.top_k, rule.top_p, rule.seed, positions, step
    )
    if step + 1 >= rule.cap:
        keep = set(range(len(slots)))
    else:
        keep = _choose(rule.params, confs, ents, rule.seed, positions, step)
        if rule.token_shift and step == 0 and slots[0] == 0:
            keep.add(0)
    for i in keep:
        block[slots[i]], masked[slots[i]] = toks[i], False


def _emit(
    new: list[int], x: list[int], out: list[int], max_tokens: int, eos: frozenset[int]
) -> bool:
    """Commit a finished block's new tokens; True when the output ended (EOS or max_tokens)."""
    x += new
    for t in new:
        if len(out) == max_tokens:
            return True
        out.append(t)
        if t in eos:
            return True
    return len(out) == max_tokens


@torch.inference_mode()
def reference_generate(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    block_size: int,
    token_shift: bool,
    max_tokens: int,
    params: UnmaskingParams = DEFAULT_PARAMS,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_ids: frozenset[int] = frozenset(),
    max_model_len: int = 512,
    mask_token_id: int = MASK_TOKEN_ID,
) -> list[int]:
    """Block by block, no KV cache: the tokens the engine must produce (EOS inside a block ends
    the output after it; `max_tokens` truncates the last block)."""
    rule = _Rule(params, params.steps_cap(block_size), token_shift, temperature, top_k, top_p,
                 seed, mask_token_id)  # fmt: skip
    x = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens and len(x) < max_model_len:
        start = len(x) // block_size * block_size
        end = min(start + block_size, max_model_len)
        block = x[start:] + [mask_token_id] * (end - len(x))
        masked = [start + i >= len(x) for i in range(end - start)]
        step = 0
        while any(masked):
            seq = torch.tensor([x[:start] + block])
            mask = block_causal_mask(0, end, block_size)
            pos = torch.arange(end)[None]
            logits = model(input_ids=seq, attention_mask=mask, position_ids=pos).logits[0]
            slots = [i for i, m in enumerate(masked) if m]
            rows = logits[[start + s - (1 if token_shift else 0) for s in slots]].float()
            _unmask(rows, slots, block, masked, start, step, rule)
            step += 1
        if _emit(block[len(x) - start :], x, out, max_tokens, eos_token_ids):
            break
    return out


@torch.inference_mode()
def cached_generate(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    block_size: int,
    token_shift: bool,
    max_tokens: int,
    params: UnmaskingParams = DEFAULT_PARAMS,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_ids: frozenset[int] = frozenset(),
    max_model_len: int = 512,
    mask_token_id: int = MASK_TOKEN_ID,
) -> list[int]:
    """The upstream-style loop with transformers' KV cache (one request)."""
    from transformers import DynamicCache

    rule = _Rule(params, params.steps_cap(block_size), token_shift, temperature, top_k, top_p,
                 seed, mask_token_id)  # fmt: skip
    x = list(prompt)
    out: list[int] = []
    cache = DynamicCache()
    done = 0  # tokens whose KV is in the cache
    last_hidden_logits: torch.Tensor | None = None  # token shift: logits at done - 1

    def forward(ids: list[int], first: int, store: bool) -> torch.Tensor:
        nonlocal last_hidden_logits
        length = first + len(ids)
        mask = block_causal_mask(first, length, block_size)
        pos = torch.arange(first, length)[None]
        res = model(
            input_ids=torch.tensor([ids]), attention_mask=mask, position_ids=pos,
            past_key_values=cache, use_cache=True,
        )  # fmt: skip
        logits = res.logits[0].float()
        if store:
            last_hidden_logits = logits[-1]
        else:  # drop the block's keys again (a negative count removes that many)
            cache.crop(-len(ids))
        return logits

    while len(out) < max_tokens and len(x) < max_model_len:
        start = len(x) // block_size * block_size
        if done < start:
            forward(x[done:start], done, store=True)
            done = start
        end = min(start + block_size, max_model_len)
        block = x[start:] + [mask_token_id] * (end - len(x))
        masked = [start + i >= len(x) for i in range(end - start)]
        step = 0
        while any(masked):
            logits = forward(block, start, store=False)
            slots = [i for i, m in enumerate(masked) if m]
            rows = []
            for s in slots:
                if not token_shift:
                    rows.append(logits[s])
                elif s > 0:
                    rows.append(logits[s - 1])
                else:
                    assert last_hidden_logits is not None
                    rows.append(last_hidden_logits)
            _unmask(torch.stack(rows), slots, block, masked, start, step, rule)
            step += 1
        forward(block, start, store=True)  # the clean pass stores the block's KV
        done = end
        if _emit(block[len(x) - start :], x, out, max_tokens, eos_token_ids):
            break
    return out


def tokens_per_forward(committed: int, forwards: int) -> float:
    return committed / forwards if forwards else math.nan
