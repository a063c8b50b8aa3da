"""A tensor-parallel worker rank: `python -m impasto.engine.tp_worker ARGS_FILE` (started by a
local rank 0, the EngineArgs pickled by it), or `impasto tp-worker` with the same engine flags
as rank 0's command (a rank started on another node, `IMPASTO_TP_EXTERNAL_WORKERS=1` on rank 0).

Takes its rank from the environment
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, as torchrun sets them), joins the group,
builds its shard of the model and KV cache, and runs the steps rank 0 broadcasts until told
to stop (`tensor_parallel.py` holds the protocol). It exits when rank 0 is gone: the group's
connections break, or (started locally) its parent process is no longer rank 0's.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

import torch

from impasto.config.engine_args import EngineArgs


def _exit_with_parent(parent_pid: int) -> None:
    """Started by a local rank 0: end when it does (even if it never sends the stop)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str]) -> int:
    with open(argv[0], "rb") as f:
        return run_worker(pickle.load(f))


def run_worker(args: EngineArgs) -> int:
    """Serve as the rank the environment names until rank 0 stops; the exit status."""
    from impasto.engine.setup import build_components
    from impasto.engine.tensor_parallel import join_group, serve_worker, threads_per_rank

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-worker %(message)s")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != args.parallel_config().tensor_parallel_size or not 0 < rank < size:
        raise SystemExit(
            f"tp-worker: RANK={rank} WORLD_SIZE={size} do not fit --tensor-parallel-size "
            f"{args.parallel_config().tensor_parallel_size} (workers are ranks 1..N-1)"
        )
    parent = os.environ.get("IMPASTO_TP_PARENT_PID")
    if parent:
        threading.Thread(target=_exit_with_parent, args=(int(parent),), daemon=True).start()
    torch.set_num_threads(threads_per_rank(args))
    join_group(rank, size, args.device)
    parts = build_components(args)
    try:
        serve_worker(parts.runner)
    except RuntimeError as e:  # rank 0 gone: the group's connections broke
        logging.getLogger("impasto").warning("tensor-parallel rank %d: %s", rank, e)
        return 1
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
