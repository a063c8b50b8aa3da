"""Tensor parallelism across processes (`--tensor-parallel-size N`): one engine whose model is
sharded over N ranks of a `torch.distributed` group (gloo on CPU, NCCL with CUDA).

Rank 0 is the engine: it schedules, samples and answers. Ranks 1..N-1 are workers
(`python -m impasto.engine.tp_worker`) that hold their shard of every layer and of the KV
cache and run the same forward passes. They are started the way torchrun starts ranks:
rendezvous by environment (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`;
`init_method="env://"`), so the same worker runs on another node given those variables.
Rank 0 starts the local workers itself unless `IMPASTO_TP_EXTERNAL_WORKERS=1` says they are
started elsewhere (e.g. by torchrun or a job scheduler on other nodes).

Invariants:
- every rank builds the same model from the same EngineArgs, each its own shard; the KV cache
  has the same number of blocks on every rank (the smallest any rank can hold: `agree_min`),
  so rank 0's block tables are valid everywhere;
- each step, rank 0 broadcasts the SchedulerOutput *before* it runs the step, then every rank
  runs `execute_model` on it: the collectives inside the forward pass (one all-reduce after
  each row-parallel layer, one all-gather of the logits) meet in the same order on all ranks.
  Workers sample too (identical logits after the gather, identical runner-owned generators
  seeded from the engine seed): their per-request state advances exactly as rank 0's, and
  their sampled tokens are dropped;
- a worker that dies makes the engine dead (EngineDeadError): no step can run without it.
  Rank 0 closing (or dying) ends the workers: a `None` message, or a broken connection.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from impasto.config.engine_args import EngineArgs
from impasto.core.outputs import SchedulerOutput
from impasto.core.ports import free_port
from impasto.engine.step_watchdog import EngineDeadError
from impasto.models.layers.parallel import set_tensor_parallel

logger = logging.getLogger("impasto")

RENDEZVOUS_TIMEOUT_S = 300.0  # for every rank to join (they load the model first: no)
EXTERNAL_ENV = "IMPASTO_TP_EXTERNAL_WORKERS"

# Messages rank 0 broadcasts (a tuple (kind, SchedulerOutput), or None: stop).
STEP, DISCARD = "step", "discard"


def threads_per_rank(args: EngineArgs) -> int:
    """`--num-threads` per rank, else this machine's cores shared by the local ranks."""
    n = args.parallel_config().tensor_parallel_size
    return args.num_threads or max(1, (os.cpu_count() or 1) // n)


def join_group(rank: int, size: int, device: str, address: tuple[str, int] | None = None) -> None:
    """Join the process group and set this rank's tensor-parallel state for the layers.

    `address`: rank 0's (host, port); None: from the environment (env:// rendezvous)."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    init = "env://" if address is None else f"tcp://{address[0]}:{address[1]}"
    dist.init_process_group(
        backend,
        init_method=init,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )
    set_tensor_parallel(rank, size)


def broadcast(message: Any) -> Any:
    """Rank 0 sends `message`; every other rank returns it."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class TensorParallelGroup:
    """Rank 0's view of the group: the worker processes it started (none if external)."""

    size: int
    workers: list[subprocess.Popen] = field(default_factory=list)
    args_file: str | None = None
    closed: bool = False

    @classmethod
    def start(cls, args: EngineArgs) -> TensorParallelGroup:
        """Start ranks 1..N-1 (unless external) and join the group as rank 0."""
        size = args.parallel_config().tensor_parallel_size
        group = cls(size)
        address = None  # external ranks: the environment's rendezvous
        if os.environ.get(EXTERNAL_ENV) != "1":
            # This process's own rendezvous (a fresh port per engine unless MASTER_PORT is
            # set), handed to the ranks it starts; this process's environment is left alone.
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            address = (host, int(os.environ.get("MASTER_PORT") or free_port()))
            fd, group.args_file = tempfile.mkstemp(prefix="impasto-tp-", suffix=".pkl")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(args, f)
            for rank in range(1, size):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
                env.update(MASTER_ADDR=host, MASTER_PORT=str(address[1]))
                env["IMPASTO_TP_PARENT_PID"] = str(os.getpid())
                cmd = [sys.executable, "-m", "impasto.engine.tp_worker", group.args_file]
                group.workers.append(subprocess.Popen(cmd, env=env))
        torch.set_num_threads(threads_per_rank(args))
        try:
            join_group(0, size, args.device, address)
        except BaseException:
            group.close()
            raise
        logger.info("tensor parallel: %d ranks (%s), rank 0 here", size, dist.get_backend())
        return group

    def check_workers(self) -> None:
        """Raise EngineDeadError if a worker this rank started has exited."""
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is not None:
                raise EngineDeadError(
                    f"tensor-parallel rank {rank} exited (code {code}); the engine cannot go on"
                )

    def close(self, timeout_s: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        if dist.is_initialized():
            try:
                if all(p.poll() is None for p in self.workers):
                    broadcast(None)
            except Exception as e:  # noqa: BLE001 - a worker gone already: they are killed below
                logger.debug("tensor parallel: stop message not delivered: %s", e)
            dist.destroy_process_group()
            set_tensor_parallel(0, 1)
        for proc in self.workers:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self.args_file is not None:
            try:
                os.unlink(self.args_file)
            except FileNotFoundError:
                pass


class TensorParallelRunner:
    """Rank 0's runner: broadcasts each step to the workers, then runs it here. Everything
    else is the wrapped runner's."""

    def __init__(self, runner: Any, group: TensorParallelGroup) -> None:
        self.runner = runner
        self.group = group

    def execute_model(self, so: SchedulerOutput) -> Any:
        self.group.check_workers()
        broadcast((STEP, so))
        return self.runner.execute_model(so)

    def discard_step(self, so: SchedulerOutput) -> None:
        self.group.check_workers()
        broadcast((DISCARD, so))
        self.runner.discard_step(so)

    def __getattr__(self, name: str) -> Any:  # take_stats, proposer, ...
        return getattr(self.runner, name)


def serve_worker(runner: Any) -> None:
    """A worker rank's loop: run what rank 0 broadcasts until it says stop (or is gone)."""
    while True:
        message = broadcast(None)
        if message is None:
            return
        kind, so = message
        try:
            if kind == STEP:
                runner.execute_model(so)
            elif kind == DISCARD:
                runner.discard_step(so)
        except Exception:  # noqa: BLE001 - rank 0 failed the same step and repairs with DISCARD
            logger.exception("tensor-parallel rank %d: step failed", dist.get_rank())
