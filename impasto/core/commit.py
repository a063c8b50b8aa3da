"""Committing a step's results to its requests: what `Scheduler.update_from_output` does with a
`ModelRunnerOutput` once the runner is done.

`schedule()` advanced every scheduled request's `num_computed_tokens` optimistically, drafts
and canvas included. Here, per request of the step:

- a request that is no longer running (aborted, or preempted between `schedule()` and here) is
  skipped: its results are dropped, since a preempted request lost the step's KV and samples
  that position again after it resumes;
- a request the runner failed, or returned nothing for, ends with an error output;
- the rejected part of its drafts or canvas is rolled back from `num_computed_tokens` (AR:
  the sampled tokens before the last, the bonus or correction, are the accepted drafts;
  diffusion samples no bonus token);
- the sampled tokens are appended one by one through the stop check; those past a stop are
  dropped, so nothing is committed after the request finished;
- masked block diffusion: `num_computed_tokens` stops at the last committed token's block
  boundary, as a block's KV is final only once the whole block is committed;
- a request that goes on takes the runner's fresh drafts (or updated canvas), unless it is
  still in a prefill chunk.

The requests that stopped or failed are handed back to the caller in step order: this module
changes request state and the acceptance counters only, never `running` or the KV cache.
"""

from __future__ import annotations

from impasto.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from impasto.core.request import Request, RequestStatus
from impasto.core.spec_stats import SpecStats
from impasto.core.stop import check_stop


def commit_step(
    requests: dict[str, Request],
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    *,
    max_model_len: int,
    num_sampled_tokens_per_step: int,
    masked_block_size: int,
    spec_stats: SpecStats,
) -> tuple[list[EngineCoreOutput], list[Request]]:
    """Commit one step's results: (the outputs to send, the requests that stopped or failed)."""
    s = num_sampled_tokens_per_step
    block = masked_block_size
    index = runner_output.index_of()
    outputs: list[EngineCoreOutput] = []
    stopped: list[Request] = []
    for rid in scheduler_output.num_scheduled_tokens:
        request = requests.get(rid)
        if request is None or request.status != RequestStatus.RUNNING:
            continue  # aborted or preempted while the step ran
        error = runner_output.failed_req_ids.get(rid)
        idx = index.get(rid)
        if error is None and idx is None:
            error = "the model runner returned no output for this request"
        if error is not None or idx is None:
            request.status = RequestStatus.FINISHED_ERROR
            stopped.append(request)
            outputs.append(EngineCoreOutput(rid, [], True, "error", error=error))
            continue
        generated = runner_output.sampled_token_ids[idx]
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens.get(rid)
        if scheduled_spec and (generated or s == 0):
            # AR: the last sampled token is the bonus/correction; diffusion samples none.
            num_accepted = max(len(generated) - s, 0)
            num_rejected = len(scheduled_spec) - num_accepted
            if num_rejected > 0:
                request.num_computed_tokens -= num_rejected
            if not block:  # a block's canvas is no draft list
                spec_stats.observe(len(scheduled_spec), num_accepted)

        new_tokens: list[int] = []
        for token in generated:
            request.append_output_token_ids(token)
            new_tokens.append(token)
            if check_stop(request, max_model_len):
                break  # tokens accepted past a stop are dropped
        if block:  # block-causal: KV is final up to the last committed token's block
            n = request.num_tokens
            request.num_computed_tokens = min(request.num_computed_tokens, n - n % block)
        finished = request.is_finished
        if finished:
            stopped.append(request)
        elif runner_output.spec_token_ids is not None and not request.is_prefill_chunk:
            request.spec_token_ids = list(runner_output.spec_token_ids[idx])
        if new_tokens or finished:
            logprobs = runner_output.logprobs.get(rid)
            outputs.append(
                EngineCoreOutput(
                    rid,
                    new_tokens,
                    finished,
                    request.get_finished_reason(),
                    request.stop_reason,
                    new_logprobs=logprobs[: len(new_tokens)] if logprobs else None,
                    prompt_logprobs=runner_output.prompt_logprobs.get(rid),
                    num_cached_tokens=request.num_cached_prompt_tokens,
                )
            )
        elif rid in runner_output.prompt_logprobs:
            outputs.append(
                EngineCoreOutput(rid, [], prompt_logprobs=runner_output.prompt_logprobs[rid])
            )
    return outputs, stopped
