"""Stop checks run in the core after each appended token (stop strings live in the front end)."""

from __future__ import annotations

from pagedllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` stops at its last output token; if so, set its status.

    In order: a stop token (``stop_token_ids``, then EOS unless ``ignore_eos``) ends it with
    FINISHED_STOPPED, but only once ``min_tokens`` tokens came before it (the sampler masks
    these tokens until then, as this check mirrors); then ``max_tokens`` and
    ``max_model_len`` end it with FINISHED_LENGTH_CAPPED. ``stop_reason`` is the stop token id,
    or None for EOS and length.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    # The last token is output number num_output_tokens; min_tokens tokens must precede it.
    if request.num_output_tokens > params.min_tokens:
        if last in (params.stop_token_ids or ()):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
    if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
