"""Helpers for tests and plugin authors, modelled on vLLM's scheduler test utilities.

sched = make_scheduler(num_speculative_tokens=3, enable_prefix_caching=True)
for r in make_requests(2, num_tokens=33, same_prompt=True):
    sched.add_request(r)
out = sched.schedule()
sched.update_from_output(out, runner_output({"0": [100]}, spec={"0": [1, 2, 3]}))

`run_workload` drives an engine through staggered arrivals and checks that nothing is left
behind; `FaultInjector` puts faults into a live model runner (an engine's `engine.runner`) at chosen
steps: for the fault-injection tests and for anyone checking their own runner or model.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from impasto.config.scheduler import SchedulerConfig
from impasto.core.outputs import ModelRunnerOutput
from impasto.core.request import Request
from impasto.core.scheduler import Scheduler
from impasto.sampling_params import SamplingParams

EOS_TOKEN_ID = 50256  # eos of the test requests; prompts never contain it


def make_scheduler(
    block_size: int = 16,
    num_blocks: int = 10000,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = False,
    enable_chunked_prefill: bool = True,
    num_speculative_tokens: int | None = None,
    diffusion_canvas_length: int | None = None,
    uniform_spec_decode_padding: bool | None = None,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    num_lookahead_tokens: int = 0,
    masked_block_size: int = 0,
    mask_token_id: int = 3,
) -> Scheduler:
    """A scheduler with a fake pool. A canvas length makes it a diffusion scheduler (spec
    tokens = canvas, num_sampled_tokens_per_step = 0); a masked block size makes it a masked
    block-diffusion scheduler. Padding defaults to on whenever speculative tokens are
    configured, so tests exercise it."""
    if masked_block_size:
        num_spec, sampled = 2 * masked_block_size, 0
    elif diffusion_canvas_length is not None:
        num_spec, sampled = diffusion_canvas_length, 0
    else:
        num_spec, sampled = num_speculative_tokens or 0, 1
    if uniform_spec_decode_padding is None:
        uniform_spec_decode_padding = num_spec > 0
    return Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len or max_num_batched_tokens,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,  # type: ignore[arg-type]
            num_speculative_tokens=num_spec,
            num_lookahead_tokens=num_lookahead_tokens,
            num_sampled_tokens_per_step=sampled,
            uniform_spec_decode_padding=uniform_spec_decode_padding,
            masked_block_size=masked_block_size,
            mask_token_id=mask_token_id if masked_block_size else -1,
        )
    )


def make_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_tokens: int = 16,
    same_prompt: bool = False,
    req_ids: list[str] | None = None,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    priorities: list[int] | None = None,
    arrival_times: list[float] | None = None,
) -> list[Request]:
    """Prompts are `[i] * num_tokens` (or `[0] * num_tokens` with `same_prompt`); ids "0", "1"…"""
    requests = []
    for i in range(num_requests):
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
        )
        requests.append(
            Request(
                request_id=req_ids[i] if req_ids else str(i),
                prompt_token_ids=[0 if same_prompt else i] * num_tokens,
                sampling_params=params,
                eos_token_id=EOS_TOKEN_ID,
                arrival_time=arrival_times[i] if arrival_times else float(i),
                priority=priorities[i] if priorities else 0,
            )
        )
    return requests


def runner_output(
    sampled: dict[str, list[int]], spec: dict[str, list[int]] | None = None
) -> ModelRunnerOutput:
    """A `ModelRunnerOutput`: tokens sampled this step, and next step's spec tokens."""
    req_ids = list(sampled)
    spec_ids = None
    if spec is not None:
        spec_ids = [list(spec.get(rid, [])) for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[list(sampled[rid]) for rid in req_ids],
        spec_token_ids=spec_ids,
    )


@dataclass
class Arrival:
    """A request that arrives before engine step `step` (steps count from 0)."""

    step: int
    rid: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class WorkloadResult:
    tokens: dict[str, list[int]]  # every token each request produced
    reasons: dict[str, str]  # finish reason of each request
    metrics: dict[str, float]
    steps: int


def run_workload(engine: Any, workload: list[Arrival]) -> WorkloadResult:
    """Run an `LLMEngine` over the arrivals (sorted by step) until every request finished,
    checking the KV pool after every step; at the end, no runner row and no KV block may be
    held (blocks in the prefix cache count as free)."""
    pending = sorted(workload, key=lambda a: a.step)
    tokens: dict[str, list[int]] = {a.rid: [] for a in workload}
    reasons: dict[str, str] = {}
    kv = engine.scheduler.kv_cache_manager
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.rid, {"prompt_token_ids": a.prompt}, a.params)
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                reasons[out.request_id] = out.outputs[0].finish_reason
        kv.check_integrity()
        step += 1
    engine.step()  # lets the runner drop the last finished requests
    runner = engine.runner
    assert runner.batch.num_reqs == 0 and not runner.requests, "runner rows left behind"
    assert kv.num_free_blocks == engine.scheduler.config.num_blocks - 1, "KV blocks leaked"
    metrics = {m.name: m.value for m in engine.get_metrics()}
    return WorkloadResult(tokens, reasons, metrics, step)


FaultKind = Literal["raise", "raise_before_update", "nan", "inf", "hang"]


class InjectedFault(RuntimeError):
    """The exception a `FaultInjector` raises inside a step."""


class FaultInjector:
    """Faults at chosen steps of a model runner (steps count the runner's calls that schedule
    something, from 0):

    - "raise": the model's forward raises (after the runner applied the step's diffs);
    - "raise_before_update": execute_model raises before it looks at the step at all;
    - "nan" / "inf": one element of a random row of the logits the step samples from is
      poisoned (at the next step that samples, if this one does not; for runners that compute
      logits only to sample: no prompt logprobs);
    - "hang": the model's forward sleeps `hang_s` seconds (`float("inf")`: until `release()`).

    `hit` holds, per injection, the request ids it can affect: every request of the step for
    "raise" / "raise_before_update" / "hang" (all of them must fail); for "nan" / "inf" the
    step's requests, of which exactly one (the owner of the poisoned row) must fail.
    `uninstall()` restores the runner.
    """

    def __init__(
        self,
        runner: Any,
        kind: FaultKind,
        steps: Iterable[int],
        *,
        hang_s: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.runner, self.kind, self.steps = runner, kind, set(steps)
        self.hang_s = hang_s
        self.rng = random.Random(seed)
        self.hit: list[set[str]] = []
        self.step = -1
        self._armed = False  # this step raises / hangs in the model's forward
        self._poison = False  # the next logits computed get a NaN / inf
        self._released = threading.Event()
        self._scheduled: set[str] = set()
        self._execute = runner.execute_model
        self._forward = runner.model.forward
        self._logits = runner.model.compute_logits
        runner.execute_model = self._execute_model
        runner.model.forward = self._model_forward
        runner.model.compute_logits = self._compute_logits

    def uninstall(self) -> None:
        self.release()
        self.runner.execute_model = self._execute
        del self.runner.model.forward, self.runner.model.compute_logits  # back to the class's

    def release(self) -> None:
        """End a hang now."""
        self._released.set()

    def _execute_model(self, so: Any) -> Any:
        if so.num_scheduled_tokens:
            self.step += 1
            if self.step in self.steps:
                if self.kind == "raise_before_update":
                    self.hit.append(set(so.num_scheduled_tokens))
                    raise InjectedFault(f"injected before step {self.step}'s update")
                if self.kind in ("nan", "inf"):
                    self._poison = True
                else:
                    self.hit.append(set(so.num_scheduled_tokens))
                    self._armed = True
        self._scheduled = set(so.num_scheduled_tokens)
        try:
            return self._execute(so)
        finally:
            self._armed = False

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._armed and self.kind == "raise":
            raise InjectedFault(f"injected into step {self.step}'s forward")
        if self._armed and self.kind == "hang":
            deadline = time.monotonic() + self.hang_s
            while not self._released.is_set() and time.monotonic() < deadline:
                self._released.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
        return self._forward(*args, **kwargs)

    def _compute_logits(self, *args: Any, **kwargs: Any) -> Any:
        logits = self._logits(*args, **kwargs)
        if self._poison:
            self._poison = False  # one poisoned row per injection
            self.hit.append(self._scheduled)
            row = self.rng.randrange(logits.shape[0])
            logits[row, self.rng.randrange(logits.shape[1])] = (
                float("nan") if self.kind == "nan" else float("inf")
            )
        return logits


def save_byte_tokenizer(
    path: Any, eos_token: str = "<eos>", chat_template: str | None = None
) -> int:
    """Save a byte-level tokenizer without merges into the HF folder `path`: ids 0..255 are
    the bytes (GPT-2's byte-to-character alphabet), id 256 is `eos_token`. Any text encodes
    (one token per UTF-8 byte) and decodes back exactly, so tiny random checkpoints of
    vocabulary >= 257 can run text features (structured outputs, stop strings). Returns the
    EOS id. `chat_template`: saved with it (a Jinja chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": eos_token})
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return int(fast.eos_token_id)


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet spells as `char`."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    code = ord(char)
    if code in printable:
        return code
    missing = [b for b in range(256) if b not in printable]
    return missing[code - 256]
