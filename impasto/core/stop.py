"""Token-level stop checks, in vLLM's order. Stop *strings* are the detokenizer's job."""

from __future__ import annotations

from impasto.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Check the request after its newest token was appended; set status if it must stop.

    vLLM's order: an EOS or stop token ends the request with "stop" even when it is also the
    last token that fits (max_tokens or max_model_len); only then the length caps apply. Below
    min_tokens the stop tokens do not count, but the context is never exceeded.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
