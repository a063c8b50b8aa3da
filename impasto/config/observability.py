"""What the engine reports about itself beyond the Prometheus metrics (always collected)."""

from __future__ import annotations

from dataclasses import dataclass

from impasto.errors import InvalidParameterError


@dataclass(frozen=True)
class ObservabilityConfig:
    # vLLM's `--disable-log-stats`: no periodic throughput / queue / KV-usage log line.
    disable_log_stats: bool = False
    log_stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.log_stats_interval_s > 0:
            raise InvalidParameterError(
                "log_stats_interval_s",
                f"log_stats_interval_s must be > 0, got {self.log_stats_interval_s}.",
            )
