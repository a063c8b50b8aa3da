"""A request as the scheduler sees it: token lists, progress counters, status."""

from __future__ import annotations

import enum
import time

from impasto.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Order matters: every status above PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Mutable per-request state owned by the scheduler.

    Invariants:
    - `all_token_ids == prompt_token_ids + output_token_ids` (committed tokens only);
    - `num_computed_tokens` counts tokens whose KV is (or, optimistically within a step, will be)
      in the cache; it may exceed `num_tokens` only between `schedule()` and
      `update_from_output()` of a step that ran drafts or a canvas;
    - `spec_token_ids` are never committed and never hashed.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "max_tokens",
        "status",
        "stop_reason",
        "num_computed_tokens",
        "spec_token_ids",
        "num_preemptions",
        "block_hashes",
        "is_prefill_chunk",
        "num_cached_prompt_tokens",
        "_output_token_ids",
        "_all_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty.")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # None means "until max_model_len": the stop check caps by length anyway.
        self.max_tokens: int = sampling_params.max_tokens or (1 << 62)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # chained hashes of full committed blocks
        self.is_prefill_chunk = False  # set after each schedule: prompt not fully computed yet
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first admission
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)

    # -- tokens -------------------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    # -- status -------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Priority-queue order: lower priority value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"spec={len(self.spec_token_ids)})"
        )
