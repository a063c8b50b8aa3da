"""Token-level stop checks, in vLLM's order. Stop *strings* are the detokenizer's job."""

from __future__ import annotations

from impasto.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Check the request after its newest token was appended; set status if it must stop."""
    # Never run past the context, whatever min_tokens says.
    if request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
