"""How the engine spreads over processes and threads. One process, one rank today."""

from __future__ import annotations

from dataclasses import dataclass

from impasto.errors import InvalidParameterError


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # torch intra-op threads (None: torch's default, all cores)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise InvalidParameterError(
                "tensor_parallel_size", "tensor_parallel_size > 1 is not supported yet."
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidParameterError(
                "num_threads", f"num_threads must be at least 1, got {self.num_threads}."
            )
