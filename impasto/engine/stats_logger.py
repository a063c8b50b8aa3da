"""The periodic stats log line (vLLM's "Avg prompt throughput ..."), off with
`disable_log_stats`. Reads the engine's metrics; never changes them."""

from __future__ import annotations

import logging

from impasto.config.observability import ObservabilityConfig
from impasto.engine.metrics import EngineMetrics

logger = logging.getLogger("impasto")


class StatsLogger:
    def __init__(self, config: ObservabilityConfig, metrics: EngineMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._last: tuple[float, float, float] | None = None  # (time, prompt, generation)

    def maybe_log(self, now: float) -> str | None:
        """Log (and return) the line when an interval has passed since the previous one."""
        if self.config.disable_log_stats:
            return None
        c, g = self.metrics.counters, self.metrics.gauges
        prompt, gen = c["impasto:prompt_tokens"], c["impasto:generation_tokens"]
        if self._last is None:
            self._last = (now, prompt, gen)
            return None
        t0, p0, g0 = self._last
        elapsed = now - t0
        if elapsed < self.config.log_stats_interval_s:
            return None
        self._last = (now, prompt, gen)
        line = (
            f"Avg prompt throughput: {(prompt - p0) / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {(gen - g0) / elapsed:.1f} tokens/s, "
            f"Running: {g['impasto:num_requests_running']:.0f} reqs, "
            f"Waiting: {g['impasto:num_requests_waiting']:.0f} reqs, "
            f"KV cache usage: {100 * g['impasto:kv_cache_usage_perc']:.1f}%"
        )
        logger.info(line)
        return line
