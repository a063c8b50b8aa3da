"""What one `Scheduler.schedule()` call has handed out so far: budget, scheduled counts, spec
tokens, new blocks, and the requests admitted, resumed or preempted in the step.

Invariant: `token_budget + sum(num_scheduled)` is the step's `max_num_batched_tokens`;
`give_back` undoes a request's share exactly (a victim preempted later in the same step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from impasto.core.request import Request


@dataclass(slots=True)
class ScheduleStep:
    """What one `schedule()` call has handed out so far."""

    token_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    # A running request got a prefill chunk: this step's batch is not a uniform decode batch.
    prefill_scheduled: bool = False

    def take(self, request: Request, n: int, block_ids: list[int]) -> None:
        self.num_scheduled[request.request_id] = n
        self.new_block_ids[request.request_id] = block_ids
        self.token_budget -= n

    def give_back(self, request: Request) -> None:
        """Undo the scheduling of a request preempted later in the same step (a no-op if it
        was not scheduled). `prefill_scheduled` stays: it only gates admission, and a step
        that preempted admits nobody."""
        rid = request.request_id
        if rid not in self.num_scheduled:
            return
        self.token_budget += self.num_scheduled.pop(rid)
        self.spec_tokens.pop(rid, None)
        self.new_block_ids.pop(rid, None)
        self.scheduled_running.remove(request)
