"""The engine: add_request / step / abort over scheduler + runner, with detokenization.

One step reads as three verbs: schedule -> execute -> update_from_output. A failure inside
a step fails the requests of that step, with an error, and the engine goes on.
"""

from __future__ import annotations

import logging
import time
import traceback
from itertools import count

from impasto.core import ModelRunnerOutput, Request, RequestStatus, Scheduler
from impasto.core.outputs import EngineCoreOutput
from impasto.engine.args import EngineArgs
from impasto.engine.diffusion_config import validate_diffusion_params
from impasto.engine.metrics import EngineMetrics, Metric
from impasto.engine.request_tracker import RequestTracker
from impasto.engine.setup import EngineComponents, build_components
from impasto.engine.spec_config import unsupported_sampling_param
from impasto.outputs import RequestOutput
from impasto.sampling_params import SamplingParams
from impasto.worker.diffusion import DiffusionModelRunner

logger = logging.getLogger("impasto")

PromptType = str | list[int] | dict


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        parts: EngineComponents = build_components(args)
        self.model_path = parts.model_path
        self.hf_config = parts.hf_config
        self.tokenizer = parts.tokenizer
        self.eos_token_id = parts.eos_token_id
        self.extra_stop_ids = parts.extra_stop_ids
        self.max_model_len = parts.scheduler_config.max_model_len
        self.vocab_size = parts.vocab_size
        self.scheduler = Scheduler(parts.scheduler_config)
        self.runner = parts.runner
        self.speculative_config = parts.speculative_config
        # Diffusion LMs: the runner's canvas counters feed the metrics after every step.
        diffusion = isinstance(self.runner, DiffusionModelRunner)
        self.diffusion_stats = self.runner.stats if diffusion else None
        self.image_token_id = getattr(self.runner.model, "image_token_id", None)
        self.metrics = EngineMetrics()
        self.tracker = RequestTracker(self.tokenizer)
        self._ids = count()

    # -- admission ----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                err = ValueError("multi-modal inputs (images) are not supported: text only.")
                err.param = "multi_modal_data"  # type: ignore[attr-defined]
                raise err
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set).")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("The prompt is empty: at least one token is needed.")
        n = len(prompt_ids)
        max_tokens = params.max_tokens or 0
        if n >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + max_tokens} tokens ({n} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion."
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
        if self.diffusion_stats is not None:
            validate_diffusion_params(params)
            if self.image_token_id is not None and self.image_token_id in prompt_ids:
                err = ValueError("image inputs are not supported: this engine serves text only.")
                err.param = "prompt"  # type: ignore[attr-defined]
                raise err
        if self.speculative_config is not None:
            problem = unsupported_sampling_param(params)
            if problem is not None:  # refused here, never mid-generation
                err = ValueError(problem[1])
                err.param = problem[0]  # type: ignore[attr-defined]
                raise err

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and enqueue. Raises ValueError (nothing is enqueued) on bad input."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.tracker.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use.")
        text, prompt_ids = self.tokenize_prompt(prompt)
        self.validate(prompt_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self.tracker.add(request_id, text, prompt_ids, params)
        for child_id, child_params in children:
            child_params.update_from_tokenizer(self.eos_token_id, self.extra_stop_ids)
            self.scheduler.add_request(
                Request(
                    child_id,
                    prompt_ids,
                    child_params,
                    self.eos_token_id,
                    arrival_time=arrival,
                    priority=priority,
                )
            )
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = [c for rid in ids for c in self.tracker.child_ids(rid)]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self.tracker.drop(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        try:
            runner_out = self.runner.execute_model(so)
        except Exception as e:  # noqa: BLE001 - isolate the failure to this step's requests
            logger.error("step failed: %s\n%s", e, traceback.format_exc())
            message = f"{type(e).__name__}: {e}"
            runner_out = ModelRunnerOutput([], [])
            runner_out.failed_req_ids = dict.fromkeys(so.num_scheduled_tokens, message)
        core_outputs = self.scheduler.update_from_output(so, runner_out)
        self._count_prompt_tokens(so)
        stats = self.scheduler.make_stats()
        self.metrics.observe_scheduler(stats)
        if self.diffusion_stats is not None:
            self.metrics.observe_diffusion(self.diffusion_stats.take())
        return self._process(core_outputs)

    def _count_prompt_tokens(self, so) -> None:
        for new in so.scheduled_new_reqs:
            n = len(new.prompt_token_ids) - new.num_computed_tokens
            self.metrics.inc("impasto:prompt_tokens", max(n, 0))

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        changed: dict[str, None] = {}
        for out in core_outputs:
            self.metrics.inc("impasto:generation_tokens", len(out.new_token_ids))
            stop_hit = self.tracker.update(out)
            if stop_hit:  # a stop string ended it: finish it in the scheduler too
                self.scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED)
            if out.finished or stop_hit:
                key = "impasto:request_failure" if out.finish_reason == "error" else None
                self.metrics.inc(key or "impasto:request_success")
            parent = self.tracker.parent_of(out.req_id)
            if parent is not None:
                changed[parent] = None
        results = []
        for parent in changed:
            result = self.tracker.make_output(parent)
            if result is not None:
                results.append(result)
                if result.finished:
                    self.tracker.drop(parent)
        return results

    def get_metrics(self) -> list[Metric]:
        return self.metrics.snapshot()
