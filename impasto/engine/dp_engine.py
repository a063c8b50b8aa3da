"""The offline `LLM`'s engine when `data_parallel_size > 1`: the data-parallel front end
(`dp_client.py`) driven from synchronous code, with `LLMEngine`'s interface.

The engines run in their own processes; this object owns a private asyncio loop on a
background thread that talks to them. Admission happens here, in the caller's process, through
the same `InputProcessor` the engines use (a bad prompt raises before anything is sent), and
`step()` returns the `RequestOutput` deltas that arrived since the previous call, as
`LLMEngine.step()` does.

Invariants:
- every request added gets exactly one finished output: its last delta, or an output with
  `finish_reason="error"` when its engine refused or failed it or died;
- `step()` blocks only while something is unfinished, and at most `_STEP_WAIT_S` at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from itertools import count
from typing import Any

from impasto.config.engine_args import EngineArgs
from impasto.config.model import ModelConfig
from impasto.engine import ipc
from impasto.engine.dp_client import DataParallelEngineClient
from impasto.engine.engine_client import EngineDeadError, EngineRequestError
from impasto.engine.metrics import Metric
from impasto.engine.processor import EngineRequest, InputProcessor, PromptType
from impasto.loader.packaged_models import resolve_model
from impasto.loader.tokenizer import load_tokenizer
from impasto.outputs import CompletionOutput, Logprob, RequestOutput
from impasto.sampling_params import SamplingParams

_STEP_WAIT_S = 0.5


def from_wire(delta: ipc.RequestDelta, request: EngineRequest) -> RequestOutput:
    """A delta message back as the engine's `RequestOutput` delta (inverse of `ipc.to_wire`)."""

    def position(entries: list[ipc.LogprobEntry]) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank, text) for t, lp, rank, text in entries}

    comps = [
        CompletionOutput(
            c.index,
            c.text,
            list(c.token_ids),
            c.cumulative_logprob,
            None if c.logprobs is None else [position(p) for p in c.logprobs],
            c.finish_reason,
            c.stop_reason,
        )
        for c in delta.completions
    ]
    prompt_lps = None
    if delta.prompt_logprobs is not None:
        prompt_lps = [None if p is None else position(p) for p in delta.prompt_logprobs]
    return RequestOutput(
        delta.request_id,
        request.prompt,
        request.prompt_token_ids,
        comps,
        delta.finished,
        prompt_lps,
        delta.num_cached_tokens,
    )


def _failed(request: EngineRequest, message: str) -> RequestOutput:
    n = request.params.n
    comps = [CompletionOutput(i, "", [], finish_reason="error", stop_reason=message)
             for i in range(n)]  # fmt: skip
    return RequestOutput(
        request.request_id, request.prompt, request.prompt_token_ids, comps, finished=True
    )


@dataclass(frozen=True)
class FrontEndConfig:
    """The part of the engines' `EngineConfig` a front end knows (what admission needs)."""

    model: ModelConfig


class DataParallelLLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        path = resolve_model(args.model)  # fetched once here, not by every engine
        self.args = args = dataclasses.replace(args, model=str(path))
        self.tokenizer = (
            None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or path)
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="impasto-dp-frontend", daemon=True
        )
        self._thread.start()
        self.client = DataParallelEngineClient(args, log_level="warning")
        self._run(self.client.start())
        assert self.client.model_config is not None
        self.model_config: ModelConfig = self.client.model_config
        self.config = FrontEndConfig(self.model_config)
        self.max_model_len = self.model_config.max_model_len
        self.vocab_size = self.model_config.vocab_size
        priority = args.scheduling_policy == "priority"
        self.processor = InputProcessor(self.model_config, self.tokenizer, priority)
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._tasks: dict[str, concurrent.futures.Future] = {}  # request id -> its stream
        self._ids = count()
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # -- admission ----------------------------------------------------------------------------
    def process_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        request_id = request_id if request_id is not None else str(next(self._ids))
        return self.processor.process(
            request_id, prompt, params or SamplingParams(), arrival_time=arrival_time,
            priority=priority,
        )  # fmt: skip

    def add_request(self, request_id, prompt, params=None, priority: int = 0) -> str:
        request = self.process_request(request_id, prompt, params, priority=priority)
        self.add_engine_request(request)
        return request.request_id

    def add_engine_request(self, request: EngineRequest) -> None:
        if request.request_id in self._tasks:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        fut = asyncio.run_coroutine_threadsafe(self._stream(request), self._loop)
        self._tasks[request.request_id] = fut

    async def _stream(self, request: EngineRequest) -> None:
        try:
            async for delta in self.client.generate(request):
                self._outputs.put(from_wire(delta, request))
        except (EngineRequestError, EngineDeadError) as e:
            self._outputs.put(_failed(request, str(e)))

    # -- the step -----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._tasks)

    def step(self) -> list[RequestOutput]:
        if not self._tasks:
            return []
        outs = []
        try:
            outs.append(self._outputs.get(timeout=_STEP_WAIT_S))
            while True:
                outs.append(self._outputs.get_nowait())
        except queue.Empty:
            pass
        for out in outs:
            if out.finished:
                self._tasks.pop(out.request_id, None)
        return outs

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            fut = self._tasks.pop(rid, None)
            if fut is not None:
                fut.cancel()  # leaving the stream aborts the request in its engine

    # -- utilities ----------------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        method = "reset_prefix_cache_running" if reset_running_requests else "reset_prefix_cache"
        states = self._run(self.client.call_utility(method))
        return all(s.get("reset", False) for s in states["engines"].values())

    def get_metrics(self) -> list[Metric]:
        rows = self._run(self.client.call_utility("metrics"))["metrics"]
        return [
            Metric(name, value, kind, doc, {"engine": str(engine)})
            for name, value, kind, doc, engine in rows
        ]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._run(self.client.shutdown(), timeout_s=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
