"""Data parallelism: N engine processes behind one front end, with a router in front of them.

`DataParallelEngineClient` has the interface of `AsyncEngineClient` (the server and the offline
`LLM` use either), and owns one `AsyncEngineClient` per engine. Each engine is a full engine —
its own scheduler, KV cache and model copy — started by the configured launcher (local
processes, or Ray actors), on its share of the cores: the cores this process may use are split
into N contiguous groups, each engine pinned to one with that many torch threads.

Invariants:
- a request lives on exactly one engine, chosen once by the router (`router.py`) among the
  live engines; its stream, aborts and errors are that engine's;
- an engine's death fails only the requests it held (`EngineDeadError` on their streams);
  the router stops choosing it and the others serve on. `died` is set (and the server exits)
  only when every engine is dead;
- `/metrics` gets every engine's metrics labelled `engine="<index>"`, plus the router's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from impasto.config.engine_args import EngineArgs
from impasto.config.model import ModelConfig
from impasto.engine import ipc
from impasto.engine.engine_client import AsyncEngineClient, EngineDeadError
from impasto.engine.processor import EngineRequest
from impasto.engine.router import EngineLoad, NoEngineError, Router, make_router

logger = logging.getLogger("impasto")


def split_cores(cores: list[int], n: int) -> list[tuple[int, ...] | None]:
    """N contiguous groups of the cores (sizes differ by at most one); None for every engine
    when there are fewer cores than engines (then nobody is pinned: they share them)."""
    if len(cores) < n:
        return [None] * n
    base, extra = divmod(len(cores), n)
    groups: list[tuple[int, ...] | None] = []
    start = 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        groups.append(tuple(cores[start : start + size]))
        start += size
    return groups


def engine_args_for(args: EngineArgs, cpus: tuple[int, ...] | None, n: int) -> EngineArgs:
    """One engine's arguments: a single engine, with its share of the threads (the user's
    `num_threads` is per engine when given)."""
    threads = args.num_threads
    if threads is None:
        threads = len(cpus) if cpus else max(1, (os.cpu_count() or 1) // n)
    return dataclasses.replace(args, data_parallel_size=1, num_threads=threads)


class DataParallelEngineClient:
    def __init__(self, args: EngineArgs, log_level: str = "info") -> None:
        parallel = args.parallel_config()
        self.args = args
        self.num_engines = n = parallel.data_parallel_size
        self.policy = parallel.data_parallel_routing
        self.parallel = parallel
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        # Ray places its actors itself: pinning here would name this machine's cores.
        groups = split_cores(cores, n) if parallel.backend != "ray" else [None] * n
        self.engines = [
            AsyncEngineClient(
                engine_args_for(args, cpus, n), log_level, cpus=cpus, index=i, num_engines=n
            )
            for i, cpus in enumerate(groups)
        ]
        self.loads = [EngineLoad() for _ in range(n)]
        self.router: Router | None = None
        self.routed = [0] * n  # requests sent to each engine
        self.predicted_hits = [0] * n  # blocks the router expected cached, per engine
        self.overrides = [0] * n  # requests sent here by the load balance, against the cache
        self._owner: dict[str, int] = {}  # request id -> engine index, while in flight
        self.model_config: ModelConfig | None = None
        self.died = asyncio.Event()  # every engine is dead
        self.dead_reason = ""
        self._watchers: list[asyncio.Task] = []

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, timeout_s: float = 900.0) -> None:
        results = await asyncio.gather(
            *(e.start(timeout_s) for e in self.engines), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.shutdown()
            raise failed[0]
        self.model_config = self.engines[0].model_config
        states = await asyncio.gather(*(e.call_utility("state") for e in self.engines))
        block_size = self.args.block_size
        p = self.parallel
        self.router = make_router(
            self.policy,
            self.num_engines,
            block_size,
            [s["num_blocks"] for s in states],
            p.router_balance_abs_threshold,
            p.router_balance_rel_threshold,
            p.router_cache_threshold,
        )
        for i, e in enumerate(self.engines):
            self._watchers.append(asyncio.create_task(self._watch(i, e), name=f"dp-watch-{i}"))
        logger.info(
            "data parallel: %d engines (pids %s), routing %s",
            self.num_engines,
            ", ".join(str(e.engine_pid) for e in self.engines),
            self.policy,
        )

    async def _watch(self, index: int, engine: AsyncEngineClient) -> None:
        await engine.died.wait()
        self.loads[index].alive = False
        if self.router is not None:
            self.router.forget_engine(index)
        alive = sum(load.alive for load in self.loads)
        logger.error(
            "engine %d died (%s): its requests failed; %d of %d engines serve on",
            index,
            engine.dead_reason,
            alive,
            self.num_engines,
        )
        if alive == 0:
            self.dead_reason = "; ".join(
                f"engine {i}: {e.dead_reason}" for i, e in enumerate(self.engines)
            )
            self.died.set()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*(e.shutdown(timeout_s) for e in self.engines))

    # -- the client interface -----------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.died.is_set()

    @property
    def is_alive(self) -> bool:
        return any(e.is_alive for e in self.engines)

    @property
    def engine_pid(self) -> int | None:
        return self.engines[0].engine_pid

    @property
    def engine_pids(self) -> list[int | None]:
        return [e.engine_pid for e in self.engines]

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len if self.model_config else 0

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size if self.model_config else 0

    @property
    def model_path(self) -> str:
        return self.model_config.model_path if self.model_config else ""

    def choose(self, request: EngineRequest) -> int:
        assert self.router is not None, "start() first"
        for i, e in enumerate(self.engines):  # a death the watcher has not seen yet
            self.loads[i].alive = self.loads[i].alive and not e.errored
        try:
            choice = self.router.choose(request.prompt_token_ids, None, self.loads)
        except NoEngineError as e:
            raise EngineDeadError(str(e)) from e
        self.routed[choice.engine] += 1
        self.predicted_hits[choice.engine] += choice.predicted_hit_blocks
        self.overrides[choice.engine] += choice.overrode_cache
        return choice.engine

    async def generate(self, request: EngineRequest) -> AsyncIterator[ipc.RequestDelta]:
        index = self.choose(request)
        load = self.loads[index]
        load.in_flight += 1
        self._owner[request.request_id] = index
        try:
            async for delta in self.engines[index].generate(request):
                yield delta
        finally:
            load.in_flight -= 1
            self._owner.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is not None:
            self.engines[index].abort(request_id)

    async def call_utility(self, method: str, timeout_s: float = 10.0) -> dict[str, Any]:
        live = [(i, e) for i, e in enumerate(self.engines) if e.is_alive]
        results = await asyncio.gather(
            *(e.call_utility(method, timeout_s) for _, e in live), return_exceptions=True
        )
        answers = [(i, r) for (i, _), r in zip(live, results, strict=True) if isinstance(r, dict)]
        if method == "metrics":
            rows = [row + [i] for i, r in answers for row in r["metrics"]]
            return {"metrics": rows + self._router_metrics()}
        keys = ("num_unfinished_requests", "num_free_blocks", "num_blocks", "num_streams")
        total = {k: sum(r.get(k, 0) for _, r in answers) for k in keys}
        return total | {"engines": {str(i): r for i, r in answers}}

    def _router_metrics(self) -> list[list]:
        rows: list[list] = []
        for i in range(self.num_engines):
            rows += [
                ["impasto:router_requests", self.routed[i], "counter",
                 f"Requests routed to the engine ({self.policy} routing).", i],
                ["impasto:router_predicted_hit_blocks", self.predicted_hits[i], "counter",
                 "KV blocks the router predicted cached on the engine it chose.", i],
                ["impasto:router_balance_overrides", self.overrides[i], "counter",
                 "Requests the load balance sent to the engine although another was "
                 "predicted to hold more of their prompt.", i],
                ["impasto:engine_alive", float(self.loads[i].alive), "gauge",
                 "1 while the engine process serves, 0 once it died.", i],
                ["impasto:engine_requests_in_flight", self.loads[i].in_flight, "gauge",
                 "Requests routed to the engine and not finished (running + waiting).", i],
            ]  # fmt: skip
        return rows


def make_engine_client(
    args: EngineArgs, log_level: str = "info"
) -> AsyncEngineClient | DataParallelEngineClient:
    """The front end's handle on its engine(s): one engine, or N behind a router."""
    if args.parallel_config().data_parallel_size > 1:
        return DataParallelEngineClient(args, log_level)
    return AsyncEngineClient(args, log_level)
