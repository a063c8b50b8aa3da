"""Engine metrics with vLLM's names under the `impasto:` prefix (counters and gauges)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from impasto.core.outputs import SchedulerStats


@dataclass
class Metric:
    name: str
    value: float
    kind: str = "counter"  # "counter" | "gauge"
    documentation: str = ""
    labels: dict[str, str] = field(default_factory=dict)  # e.g. {"engine": "1"} with DP


_COUNTERS = {
    "impasto:prompt_tokens": "Prompt tokens processed (prefill, prefix-cache hits excluded).",
    "impasto:generation_tokens": "Generated tokens.",
    "impasto:num_preemptions": "Requests preempted (recompute).",
    "impasto:prefix_cache_queries": "Tokens looked up in the prefix cache.",
    "impasto:prefix_cache_hits": "Tokens found in the prefix cache.",
    "impasto:request_success": "Requests finished (any reason but error/abort).",
    "impasto:request_failure": "Requests finished with an error.",
    "impasto:step_failed_requests": (
        "Requests failed by a model step (it raised, timed out, or gave non-finite logits)."
    ),
    "impasto:step_timeouts": "Model steps that missed the watchdog's deadline (step_timeout_s).",
    "impasto:spec_decode_num_drafts": "Speculative verification steps.",
    "impasto:spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "impasto:spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "impasto:diffusion_denoising_steps": "Diffusion denoising steps (one per request per step).",
    "impasto:diffusion_canvas_positions": "Canvas positions evaluated by denoising steps.",
    "impasto:diffusion_canvases_committed": "Diffusion canvases committed to the KV cache.",
    "impasto:diffusion_committed_tokens": "Tokens committed by canvases (before stop truncation).",
}
_GAUGES = {
    "impasto:num_requests_running": "Requests in the running set.",
    "impasto:num_requests_waiting": "Requests waiting (new or preempted).",
    "impasto:kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0-1).",
    "impasto:spec_decode_acceptance_rate": "Accepted / drafted tokens since start (0-1).",
    "impasto:spec_decode_mean_acceptance_length": (
        "Tokens committed per verification step since start: 1 + accepted / drafts."
    ),
}


class EngineMetrics:
    def __init__(self) -> None:
        self.counters = dict.fromkeys(_COUNTERS, 0.0)
        self.gauges = dict.fromkeys(_GAUGES, 0.0)
        self.spec_accepted_per_pos: list[int] = []

    def inc(self, name: str, value: float = 1.0) -> None:
        self.counters[name] += value

    def add_counters(self, increments: Mapping[str, float]) -> None:
        """Counter increments reported by the runner (e.g. the diffusion canvas counters)."""
        for name, value in increments.items():
            self.counters[name] += value

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        c, g = self.counters, self.gauges
        g["impasto:num_requests_running"] = stats.num_running_reqs
        g["impasto:num_requests_waiting"] = stats.num_waiting_reqs
        g["impasto:kv_cache_usage_perc"] = stats.kv_cache_usage
        c["impasto:num_preemptions"] += stats.num_preemptions
        c["impasto:prefix_cache_queries"] += stats.prefix_cache_queries
        c["impasto:prefix_cache_hits"] += stats.prefix_cache_hits
        c["impasto:spec_decode_num_drafts"] += stats.num_drafts
        c["impasto:spec_decode_num_draft_tokens"] += stats.num_draft_tokens
        c["impasto:spec_decode_num_accepted_tokens"] += stats.num_accepted_tokens
        drafts, drafted = (
            c["impasto:spec_decode_num_drafts"],
            c["impasto:spec_decode_num_draft_tokens"],
        )
        accepted = c["impasto:spec_decode_num_accepted_tokens"]
        if drafts:  # the bonus / correction token makes every verification commit >= 1
            g["impasto:spec_decode_acceptance_rate"] = accepted / drafted
            g["impasto:spec_decode_mean_acceptance_length"] = 1.0 + accepted / drafts
        per_pos = self.spec_accepted_per_pos
        for i, n in enumerate(stats.num_accepted_tokens_per_pos):
            if i == len(per_pos):
                per_pos.append(0)
            per_pos[i] += n

    def snapshot(self) -> list[Metric]:
        out = [Metric(k, v, "counter", _COUNTERS[k]) for k, v in self.counters.items()]
        out += [Metric(k, v, "gauge", _GAUGES[k]) for k, v in self.gauges.items()]
        for i, n in enumerate(self.spec_accepted_per_pos):
            out.append(Metric(f"impasto:spec_decode_num_accepted_tokens_per_pos[{i}]", n))
        return out
