"""Helpers for tests and plugin authors, modelled on vLLM's scheduler test utilities.

sched = make_scheduler(num_speculative_tokens=3, enable_prefix_caching=True)
for r in make_requests(2, num_tokens=33, same_prompt=True):
    sched.add_request(r)
out = sched.schedule()
sched.update_from_output(out, runner_output({"0": [100]}, spec={"0": [1, 2, 3]}))
"""

from __future__ import annotations

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
) -> Scheduler:
    """A scheduler with a fake pool. A canvas length makes it a diffusion scheduler (spec
    tokens = canvas, num_sampled_tokens_per_step = 0). Padding defaults to on whenever
    speculative tokens are configured, so tests exercise it."""
    if diffusion_canvas_length is not None:
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
