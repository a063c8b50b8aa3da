"""Shared parts of the soak scripts (`soak_ar.py`, `soak_diffusion.py`).

- tiny random checkpoints built with transformers (fixed seed, fp32), and a tiny word-level
  tokenizer whose vocabulary matches them (so stop strings and bad words can be exercised);
- `StepTap`: a pass-through observer of the scheduler outputs the runner executes;
- `state_problems` / `end_problems`: the scheduler's and the KV pool's bookkeeping, checked
  between steps and once everything finished (leaked blocks);
- `run_alone`: one request run by itself on a reference engine (the soaks' solo runs);
- `RssSampler`: resident set size sampled after a `gc.collect()`, with warm-up/end/max/drift;
- `print_table`: a plain-text summary table.

Invariants: nothing here changes what the engine computes. `StepTap` calls the runner's own
`execute_model` with the very `SchedulerOutput` it was given and returns its result untouched;
its observer only reads. Checkpoints are deterministic for a given seed and shape.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# -- tiny checkpoints --------------------------------------------------------------------------

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: pad, bos, eos
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def tiny_vocab(size: int) -> list[str]:
    """`size` distinct token strings: the specials, then letters, then letter pairs."""
    words = list(SPECIALS) + list(LETTERS)
    for a in LETTERS:
        for b in LETTERS:
            if len(words) >= size:
                return words[:size]
            words.append(a + b)
    if len(words) < size:
        raise ValueError(f"tiny_vocab supports at most {len(words)} tokens, asked {size}")
    return words[:size]


def save_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `tiny_vocab(vocab_size)`: decoding concatenates the words,
    so stop strings can complete across token boundaries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = tiny_vocab(vocab_size)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def build_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    vocab_size: int = 160,
    hidden_size: int = 32,
    num_layers: int = 2,
    max_positions: int = 256,
    with_tokenizer: bool = True,
) -> Path:
    """A random Llama; transformers' initialisation with matrices scaled by 3, so that greedy
    argmaxes are sharp (near ties would make batch-shape rounding visible)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    if with_tokenizer:
        save_tiny_tokenizer(path, vocab_size)
    return path


def build_tiny_diffusion_gemma(
    path: Path,
    *,
    seed: int = 1,
    canvas_length: int = 16,
    vocab_size: int = 64,
    hidden_size: int = 32,
    sliding_window: int = 16,
) -> Path:
    """A random two-layer DiffusionGemma (one sliding, one full attention layer, MoE), fp32:
    the diffusion tests' own builder (`tests/diffusion/checkpoints.py`: sharp random weights,
    a contractive self-conditioning projection) at the soak's size."""
    from tests.diffusion.checkpoints import build_checkpoint

    return build_checkpoint(
        path,
        seed=seed,
        canvas_length=canvas_length,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        moe_intermediate_size=16,
        sliding_window=sliding_window,
    )


# -- observing steps ---------------------------------------------------------------------------


class StepTap:
    """Calls `observe(scheduler_output)` before each `runner.execute_model` and
    `after(scheduler_output, runner_output)` after it; returns the runner's output as is.

    Installed as an instance attribute of the runner (the engine calls `runner.execute_model`),
    so removing it (`close`) restores the original bound method.
    """

    def __init__(
        self,
        runner: Any,
        observe: Callable[[Any], None],
        after: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.runner = runner
        self._execute = runner.execute_model
        self._observe = observe
        self._after = after
        runner.execute_model = self

    def __call__(self, so: Any) -> Any:
        self._observe(so)
        out = self._execute(so)
        if self._after is not None:
            self._after(so, out)
        return out

    def close(self) -> None:
        if self.runner.__dict__.get("execute_model") is self:
            del self.runner.execute_model


# -- engine state ------------------------------------------------------------------------------


def state_problems(engine: Any) -> list[str]:
    """What is wrong with the scheduler's and the pool's bookkeeping between two steps: the
    pool's own integrity check, running + waiting == the scheduler's requests, running requests
    hold blocks for their computed tokens, waiting ones hold none, the output processor tracks
    exactly the unfinished user requests."""
    from impasto.core import RequestStatus

    sched = engine.scheduler
    kv = sched.kv_cache_manager
    problems = []
    try:
        kv.check_integrity()
    except AssertionError as e:
        problems.append(f"KV pool integrity: {e}")
    running = {q.request_id for q in sched.running}
    waiting = {q.request_id for q in sched.waiting}
    if len(running) != len(sched.running) or len(running) > sched.config.max_num_seqs:
        problems.append(f"running set: {len(sched.running)} entries, {len(running)} distinct")
    if running & waiting or running | waiting != set(sched.requests):
        problems.append("running + waiting != the scheduler's requests")
    bs = sched.config.block_size
    for q in sched.running:
        blocks = kv.req_to_blocks.get(q.request_id, [])
        if q.status != RequestStatus.RUNNING or len(blocks) * bs < q.num_computed_tokens:
            problems.append(f"running {q} holds {len(blocks)} blocks")
        if q.num_computed_tokens > q.num_tokens:
            problems.append(f"{q} computed past its committed tokens between steps")
    for q in sched.waiting:
        if q.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            problems.append(f"waiting {q} has status {q.status.name}")
        if q.request_id in kv.req_to_blocks or q.num_computed_tokens:
            problems.append(f"waiting {q} holds KV")
    if set(kv.req_to_blocks) - running:
        problems.append(f"blocks held by non-running {sorted(set(kv.req_to_blocks) - running)}")
    op = engine.output_processor
    children = {c for parent in op.parents.values() for c in parent.children}
    if set(op.child_to_parent) != children or not set(sched.requests) <= children:
        problems.append("the output processor's children and the scheduler's requests disagree")
    return problems


def end_problems(engine: Any) -> tuple[int, int, list[str]]:
    """After the last request finished: one more step (the runner drops what finished), a
    prefix-cache reset, then (leaked blocks, usable blocks, problems)."""
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    problems = []
    if engine.has_unfinished_requests():
        problems.append("unfinished requests at the end")
    engine.step()
    if not engine.reset_prefix_cache():
        problems.append("the prefix cache could not be reset: blocks still referenced")
    total = kv.block_pool.num_blocks - 1  # block 0 is the null block
    leaked = total - kv.num_free_blocks
    if kv.req_to_blocks or sched.requests or len(sched.running) or len(sched.waiting):
        problems.append("the scheduler still holds requests")
    runner = engine.runner
    if runner.batch.num_reqs or runner.requests:
        problems.append(f"the runner still holds {len(runner.requests)} requests")
    if engine.output_processor.parents or engine.output_processor.child_to_parent:
        problems.append("the output processor still holds requests")
    try:
        kv.check_integrity()
    except AssertionError as e:
        problems.append(f"KV pool integrity at the end: {e}")
    metrics = {m.name: m.value for m in engine.get_metrics()}
    if int(metrics["impasto:num_preemptions"]) != sched.num_preemptions_total:
        problems.append("the preemption metric and the scheduler's counter disagree")
    return leaked, total, problems


def run_alone(engine: Any, prompt: list[int], params: Any) -> list[int]:
    """Run one request (a clone of `params`) on `engine` until nothing is unfinished; the
    tokens of its first completion. The soaks' reference run: `engine` must hold no other
    request, so the one given runs alone."""
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params.clone())
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == rid:
                tokens += delta.outputs[0].token_ids
    return tokens


# -- memory ------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Current resident set size (Linux: /proc/self/statm; elsewhere the peak, as a bound)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class RssSampler:
    """RSS samples taken at progress marks (requests done); the first sample at or after
    `warmup` is the warm-up reference, drift is the last sample relative to it."""

    warmup: int
    samples: list[tuple[int, int]] = field(default_factory=list)  # (progress, bytes)

    def sample(self, progress: int) -> int:
        gc.collect()
        rss = rss_bytes()
        self.samples.append((progress, rss))
        return rss

    def _after_warmup(self) -> list[int]:
        warm = [rss for at, rss in self.samples if at >= self.warmup]
        return warm or [rss for _, rss in self.samples[-1:]]

    @property
    def warm(self) -> int:
        return self._after_warmup()[0]

    @property
    def end(self) -> int:
        return self.samples[-1][1]

    @property
    def max(self) -> int:
        return max(self._after_warmup())

    @property
    def drift_pct(self) -> float:
        return 100.0 * (self.end - self.warm) / self.warm

    @property
    def max_drift_pct(self) -> float:
        return 100.0 * (self.max - self.warm) / self.warm


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def print_table(title: str, rows: Sequence[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("-" * (width + 40), flush=True)
