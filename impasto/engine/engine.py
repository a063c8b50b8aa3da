"""The engine: add_request / step / abort over scheduler + runner, with output processing.

One step reads as three verbs: schedule -> execute -> update_from_output. A failure inside
a step fails the requests of that step, with an error, and the engine goes on: a step that
raises (the runner repairs its batch), a request whose logits are not finite (the runner fails
it alone), a step that misses `step_timeout_s` (the watchdog: its requests fail now; no other
step runs until it returns, and if it is still running `DEAD_AFTER_TIMEOUTS` timeouts later the
engine is dead: `EngineDeadError`, so the process can exit and be restarted).

Requests enter through the one admission path (`InputProcessor`: tokenized and validated once);
`step()` returns per-request *deltas* (see `impasto/outputs.py`). The engine knows the runner
only through its interface (`execute_model`, `take_stats`). With `max_waiting_requests` set,
`add_request` refuses (`QueueFullError`, nothing enqueued) what would overfill the waiting
queue, a request with `n` choices counting as `n`.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from itertools import count

from impasto.config import EngineArgs, EngineConfig
from impasto.core import ModelRunnerOutput, Request, RequestStatus, Scheduler
from impasto.core.outputs import EngineCoreOutput, SchedulerOutput
from impasto.engine.metrics import EngineMetrics, Metric
from impasto.engine.output_processor import OutputProcessor
from impasto.engine.processor import EngineRequest, InputProcessor, PromptType
from impasto.engine.setup import EngineComponents, build_components
from impasto.engine.stats_logger import StatsLogger
from impasto.engine.step_watchdog import EngineDeadError, StepTimeoutError, StepWatchdog
from impasto.engine.structured.grammar import GrammarCompiler
from impasto.engine.structured.manager import StructuredOutputManager
from impasto.engine.tensor_parallel import TensorParallelGroup, TensorParallelRunner
from impasto.errors import InvalidParameterError
from impasto.outputs import RequestOutput
from impasto.sampling_params import SamplingParams
from impasto.worker.model_runner import ModelRunner

logger = logging.getLogger("impasto")

__all__ = ["DEAD_AFTER_TIMEOUTS", "EngineDeadError", "LLMEngine", "PromptType"]

DEAD_AFTER_TIMEOUTS = 4  # a timed-out step still running this many timeouts later: dead
_STUCK_POLL_S = 0.05  # how long step() waits for a timed-out step before returning nothing


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        if args.data_parallel_size > 1:  # never one engine where N were asked for
            raise InvalidParameterError(
                "data_parallel_size",
                "LLMEngine is one engine; data parallelism runs N of them behind a router "
                "(LLM(data_parallel_size=N), impasto serve --data-parallel-size N).",
            )
        self.args = args
        # the model is built on the thread its steps run on (see step_watchdog.py: OpenMP)
        self.watchdog: StepWatchdog[ModelRunnerOutput] = StepWatchdog(args.step_timeout_s)
        # Tensor parallelism: start the other ranks and join them, on the step thread.
        self.tp_group: TensorParallelGroup | None = None
        if args.parallel_config().tensor_parallel_size > 1:
            self.tp_group = self.watchdog.run_untimed(lambda: TensorParallelGroup.start(args))
        try:
            parts: EngineComponents = self.watchdog.run_untimed(lambda: build_components(args))
        except BaseException:
            self.close()
            raise
        self.config: EngineConfig = parts.config
        self.model_path = parts.model_path
        self.hf_config = parts.hf_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = self.config.model.max_model_len
        self.vocab_size = self.config.model.vocab_size
        self.scheduler = Scheduler(self.config.scheduler)
        self.runner: ModelRunner | TensorParallelRunner = parts.runner
        if self.tp_group is not None:  # each step goes to every rank
            self.runner = TensorParallelRunner(parts.runner, self.tp_group)
        priority = self.config.scheduler.policy == "priority"
        self.processor = InputProcessor(self.config.model, self.tokenizer, priority)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self.stats_logger = StatsLogger(self.config.observability, self.metrics)
        self._ids = count()
        self._timed_out: SchedulerOutput | None = None  # the step the watchdog gave up on
        self._structured: StructuredOutputManager | None = None  # built by the first such request

    # -- admission ----------------------------------------------------------------------------
    def process_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        """Admission without enqueueing: tokenize and validate (raises InvalidParameterError)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        return self.processor.process(
            request_id,
            prompt,
            params or SamplingParams(),
            arrival_time=arrival_time,
            priority=priority,
        )

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and enqueue. Raises InvalidParameterError on bad input, QueueFullError when
        the waiting queue is full (`max_waiting_requests`); either way nothing is enqueued."""
        request = self.process_request(request_id, prompt, params, arrival_time, priority)
        self.add_engine_request(request)
        return request.request_id

    def add_engine_request(self, request: EngineRequest) -> None:
        """Enqueue a request that passed admission (in this process or in the API process).
        Raises `QueueFullError` (nothing enqueued) when the waiting queue has no room for its
        `n` choices."""
        rid = request.request_id
        if self.output_processor.has(rid):
            raise InvalidParameterError("request_id", f"request id {rid!r} is already in use.")
        self.scheduler.check_waiting_room(request.params.n)
        children = self.output_processor.add(
            rid, request.prompt, request.prompt_token_ids, request.params
        )
        for child_id, child_params in children:
            child = Request(
                child_id,
                request.prompt_token_ids,
                child_params,
                child_params.eos_token_id,  # set by the admission path
                arrival_time=request.arrival_time,
                priority=request.priority,
            )
            if child_params.structured_outputs is not None:
                self.structured.submit(child)  # enters the scheduler once compiled
            else:
                self.scheduler.add_request(child)

    @property
    def structured(self) -> StructuredOutputManager:
        """The structured-output manager, built on first use (it reads the whole vocabulary)."""
        if self._structured is None:
            m = self.config.model
            stops = set(m.extra_stop_token_ids)
            if m.eos_token_id is not None:
                stops.add(m.eos_token_id)
            compiler = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(stops))
            self._structured = StructuredOutputManager(compiler)
        return self._structured

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = [c for rid in ids for c in self.output_processor.child_ids(rid)]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        if self._structured is not None:
            self._structured.remove(child_ids)
        for rid in ids:
            self.output_processor.drop(rid)

    def has_unfinished_requests(self) -> bool:
        compiling = self._structured is not None and self._structured.num_pending > 0
        return compiling or self.scheduler.has_unfinished_requests()

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do with one rank); idempotent."""
        group, self.tp_group = getattr(self, "tp_group", None), None
        if group is not None:
            self.watchdog.run_untimed(group.close)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; with `reset_running_requests`, running requests are
        preempted first (they recompute), so the reset always succeeds."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that changed, as deltas."""
        if self._timed_out is not None and not self._timed_out_step_ended():
            return []
        structured = self._structured
        failed_compiles: list[EngineCoreOutput] = []
        if structured is not None:
            ready, failed_compiles = structured.take_ready()
            for request in ready:
                self.scheduler.add_request(request)
        so = self.scheduler.schedule()
        if structured is not None:
            so.grammar_masks = structured.fill(so)  # filled while the forward pass runs
        try:
            runner_out = self.watchdog.run(lambda: self.runner.execute_model(so))
        except StepTimeoutError as e:
            logger.error(
                "step timed out after %g s: failing its %d request(s); the step is at:\n%s",
                e.timeout_s,
                len(so.num_scheduled_tokens),
                e.stack,
            )
            self.metrics.inc("impasto:step_timeouts")
            self._timed_out = so
            runner_out = _all_failed(so, str(e))
        except EngineDeadError:  # a tensor-parallel rank is gone: no step can run
            raise
        except Exception:  # noqa: BLE001 - isolate the failure to this step's requests
            # Clients get an error id, the log gets the details (no internals in responses).
            error_id = uuid.uuid4().hex[:12]
            logger.error("step failed (error id %s)\n%s", error_id, traceback.format_exc())
            self.runner.discard_step(so)
            runner_out = _all_failed(so, f"the model step failed (error id {error_id})")
        if structured is not None:
            structured.report_broken(so, runner_out)
        self.metrics.inc("impasto:step_failed_requests", len(runner_out.failed_req_ids))
        core_outputs = self.scheduler.update_from_output(so, runner_out)
        if structured is not None:
            structured.accept(core_outputs)
        core_outputs += failed_compiles
        self._count_prompt_tokens(so)
        self.metrics.observe_scheduler(self.scheduler.make_stats())
        self.metrics.add_counters(self.runner.take_stats())
        outputs, stopped = self.output_processor.process(core_outputs)
        # A stop string ended these: finish them in the scheduler too.
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if structured is not None:
            structured.remove(stopped)
        for out in core_outputs:
            self.metrics.inc("impasto:generation_tokens", len(out.new_token_ids))
            if out.finished or out.req_id in stopped:
                failed = out.finish_reason == "error"
                self.metrics.inc("impasto:request_failure" if failed else "impasto:request_success")
        self.stats_logger.maybe_log(time.monotonic())
        return outputs

    def _timed_out_step_ended(self) -> bool:
        """Wait a little for the step the watchdog gave up on. When it has ended, repair the
        runner (its requests failed long ago) and go on; raise EngineDeadError once it has run
        DEAD_AFTER_TIMEOUTS timeouts past its deadline."""
        assert self._timed_out is not None
        if self.watchdog.wait_released(_STUCK_POLL_S):
            self.runner.discard_step(self._timed_out)
            self._timed_out = None
            logger.warning("the timed-out step has ended; the engine goes on")
            return True
        timeout = self.args.step_timeout_s or 0.0
        if self.watchdog.stuck_for() > DEAD_AFTER_TIMEOUTS * timeout:
            raise EngineDeadError(
                f"a model step has been running for {timeout + self.watchdog.stuck_for():.1f} s "
                "and does not return; the engine cannot go on"
            )
        return False

    def _count_prompt_tokens(self, so: SchedulerOutput) -> None:
        for new in so.scheduled_new_reqs:
            n = len(new.prompt_token_ids) - new.num_computed_tokens
            self.metrics.inc("impasto:prompt_tokens", max(n, 0))

    def get_metrics(self) -> list[Metric]:
        return self.metrics.snapshot()


def _all_failed(so: SchedulerOutput, message: str) -> ModelRunnerOutput:
    out = ModelRunnerOutput([], [])
    out.failed_req_ids = dict.fromkeys(so.num_scheduled_tokens, message)
    return out
