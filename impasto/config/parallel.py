"""How the engine spreads over processes, threads and machines.

- `data_parallel_size` N: N independent engines (each its own process, scheduler and KV cache)
  behind one front end, which routes each request to one of them (`data_parallel_routing`).
- `tensor_parallel_size` N: one engine whose model is sharded over N ranks of a
  `torch.distributed` group (gloo on CPU, NCCL on CUDA); rank 0 schedules.
- `distributed_executor_backend`: how engine processes are started: "mp" (local processes,
  the default), "uni" (the same, vLLM's single-process name), "ray" (Ray actors on a cluster).

Invariant: every value is checked here, before anything is started, and names its argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from impasto.errors import InvalidParameterError

BACKENDS = ("mp", "uni", "ray")
# prefix_aware: the engine holding the longest cached prefix, balanced against load;
# round_robin: in turn; least_loaded: the fewest requests in flight.
ROUTING_POLICIES = ("prefix_aware", "round_robin", "least_loaded")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "mp"
    data_parallel_routing: str = "prefix_aware"
    # The prefix-aware router's knobs (SGLang's cache-aware router has the same three):
    # loads are out of balance when the busiest engine has more than `abs` requests in flight
    # beyond the idlest and more than `rel` times as many; then the idlest takes the request.
    # Otherwise a predicted cached prefix covering at least `cache_threshold` of the prompt's
    # full blocks wins.
    router_balance_abs_threshold: int = 16
    router_balance_rel_threshold: float = 1.5
    router_cache_threshold: float = 0.25
    num_threads: int | None = None  # torch intra-op threads (None: torch's default, all cores)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidParameterError(name, f"{name} must be an integer >= 1, got {value!r}.")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in BACKENDS:
            raise InvalidParameterError(
                "distributed_executor_backend",
                f"distributed_executor_backend must be one of {', '.join(BACKENDS)}, "
                f"got {backend!r}.",
            )
        if backend == "ray" and self.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "distributed_executor_backend",
                "the ray backend places data-parallel engines; tensor-parallel ranks start "
                "the torchrun way (one process per rank, rendezvous by environment), "
                "so use --distributed-executor-backend mp with --tensor-parallel-size.",
            )
        if self.data_parallel_routing not in ROUTING_POLICIES:
            raise InvalidParameterError(
                "data_parallel_routing",
                f"data_parallel_routing must be one of {', '.join(ROUTING_POLICIES)}, "
                f"got {self.data_parallel_routing!r}.",
            )
        abs_t = self.router_balance_abs_threshold
        if type(abs_t) is not int or abs_t < 0:
            raise InvalidParameterError(
                "router_balance_abs_threshold",
                f"router_balance_abs_threshold must be an integer >= 0, got {abs_t!r}.",
            )
        rel_t = self.router_balance_rel_threshold
        if isinstance(rel_t, bool) or not isinstance(rel_t, (int, float)) or not rel_t >= 1.0:
            raise InvalidParameterError(
                "router_balance_rel_threshold",
                f"router_balance_rel_threshold must be a number >= 1.0, got {rel_t!r}.",
            )
        cache_t = self.router_cache_threshold
        if (
            isinstance(cache_t, bool)
            or not isinstance(cache_t, (int, float))
            or not (0.0 <= cache_t <= 1.0)
        ):
            raise InvalidParameterError(
                "router_cache_threshold",
                f"router_cache_threshold must be a number in [0, 1], got {cache_t!r}.",
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidParameterError(
                "num_threads", f"num_threads must be at least 1, got {self.num_threads}."
            )

    @property
    def backend(self) -> str:
        return self.distributed_executor_backend or "mp"
