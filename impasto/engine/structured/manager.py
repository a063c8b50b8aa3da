"""Per-request grammar state of structured outputs, kept in step with the committed tokens.

Life of a constrained request:
1. `submit`: its constraint compiles on the grammar thread, off the step loop; the request
   waits here, not in the scheduler, so a slow compile delays no one else.
2. `take_ready` (start of every step): compiled requests go to the scheduler; one whose
   constraint failed to compile finishes with an error output instead.
3. `fill` (after scheduling): the masks of the step's constrained requests, filled on the
   grammar thread while the forward pass runs. A request with drafts gets one row per
   verification row: its matcher consumes the drafts one by one (a row per prefix), stops at
   the first draft the grammar refuses (that draft is rejected whatever the target says, so
   the rows after it are never used and stay all-allowed), then rolls back.
4. `accept` (after the step): the matcher consumes exactly the tokens the scheduler committed
   (accepted drafts, the bonus / correction token; nothing past a stop).
5. `remove`: finished, stopped and aborted requests drop their matcher.

Invariant: between steps, a matcher has consumed exactly its request's output tokens. A
matcher that breaks (a committed token it refuses) fails its request through the step's
`failed_req_ids`, like non-finite logits: alone, with an error, and the engine goes on.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from impasto.core import Request
from impasto.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from impasto.engine.structured.grammar import GrammarCompiler
from impasto.errors import InvalidParameterError
from impasto.worker.token_masks import TokenMasks

logger = logging.getLogger("impasto")


# llguidance.torch's two helpers, here because importing that module runs a torch.compile
# decorator (torch._dynamo, sympy, torch.distributed: ~115 MiB and seconds in every engine).
def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 on the CPU, every token allowed (all bits set)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_bitmask_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Write the matcher's allowed tokens into `bitmask[row]` (a contiguous CPU int32 row)."""
    assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.dim() == 2
    words = bitmask[row, :]
    assert words.is_contiguous()
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        # Compiles and mask fills on threads of their own (llguidance drops the GIL), so a
        # slow compile never delays a step's masks.
        self._compiles = ThreadPoolExecutor(1, thread_name_prefix="impasto-grammar-compile")
        self._fills = ThreadPoolExecutor(1, thread_name_prefix="impasto-grammar-masks")
        self._inflight: Future[TokenMasks] | None = None  # this step's fill
        self._pending: dict[str, tuple[Request, Future[llguidance.LLMatcher]]] = {}
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._broken: dict[str, str] = {}  # request id -> why its matcher broke

    @staticmethod
    def is_constrained(request: Request) -> bool:
        return request.sampling_params.structured_outputs is not None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pending or req_id in self._matchers

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- admission ----------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        future = self._compiles.submit(self.compiler.compile, params)
        self._pending[request.request_id] = (request, future)

    def take_ready(self) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Requests whose constraint has compiled (for the scheduler), and error outputs for
        those whose constraint did not."""
        ready: list[Request] = []
        failed: list[EngineCoreOutput] = []
        for rid, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            try:
                self._matchers[rid] = future.result()
                ready.append(request)
            except InvalidParameterError as e:
                failed.append(EngineCoreOutput(rid, [], True, "error", error=e.message))
            except Exception as e:  # noqa: BLE001 - a compile crash fails its request only
                logger.error("grammar compile failed for %s: %r", rid, e)
                failed.append(EngineCoreOutput(rid, [], True, "error", error="grammar failed"))
        return ready, failed

    # -- one step -----------------------------------------------------------------------------
    def fill(self, so: SchedulerOutput) -> Future[TokenMasks] | None:
        """Start filling the masks of the step's constrained requests (None: there are none)."""
        entries: list[tuple[str, list[int]]] = [
            (rid, so.scheduled_spec_decode_tokens.get(rid, []))
            for rid in so.num_scheduled_tokens
            if rid in self._matchers and rid not in self._broken
        ]
        if not entries:
            return None
        self._inflight = self._fills.submit(self._fill, entries)
        return self._inflight

    def _fill(self, entries: list[tuple[str, list[int]]]) -> TokenMasks:
        num_rows = sum(1 + len(drafts) for _, drafts in entries)
        bitmask = allocate_bitmask(num_rows, self.compiler.vocab_size)  # all allowed
        first_row: dict[str, int] = {}
        row = 0
        for rid, drafts in entries:
            matcher = self._matchers[rid]
            first_row[rid] = row
            fill_bitmask_row(matcher, bitmask, row)
            consumed = 0
            for token in drafts:
                if token < 0 or matcher.try_consume_tokens([token]) != 1:
                    break  # padding, or a draft the grammar refuses: rejected in any case
                consumed += 1
                fill_bitmask_row(matcher, bitmask, row + consumed)
            if consumed:
                matcher.rollback(consumed)
            row += 1 + len(drafts)
        return TokenMasks(bitmask, first_row)

    def report_broken(self, so: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Fail this step's requests whose matcher broke (they were not masked)."""
        for rid in so.num_scheduled_tokens:
            why = self._broken.get(rid)
            if why is not None:
                runner_out.failed_req_ids.setdefault(rid, why)

    def accept(self, outputs: list[EngineCoreOutput]) -> None:
        """Advance the matchers by the tokens this step committed; drop finished requests."""
        self._wait_fill()
        for out in outputs:
            matcher = self._matchers.get(out.req_id)
            if matcher is None:
                continue
            if out.finished:
                self.remove([out.req_id])
            elif out.new_token_ids and not matcher.consume_tokens(out.new_token_ids):
                why = f"the output left its structured-output grammar: {matcher.get_error()}"
                logger.error("request %s: %s", out.req_id, why)
                self._broken[out.req_id] = why

    def _wait_fill(self) -> None:
        """The step's fill uses the matchers: let it end before they change (a step that
        failed or sampled nothing never waited for it)."""
        if self._inflight is not None:
            self._inflight.exception()  # waits; its own errors were the step's
            self._inflight = None

    def remove(self, req_ids: list[str]) -> None:
        self._wait_fill()
        for rid in req_ids:
            self._matchers.pop(rid, None)
            self._broken.pop(rid, None)
            pending = self._pending.pop(rid, None)
            if pending is not None:
                pending[1].cancel()

    def shutdown(self) -> None:
        self._compiles.shutdown(wait=False, cancel_futures=True)
        self._fills.shutdown(wait=False, cancel_futures=True)
