"""Accumulator for speculative (AR drafts) and canvas (diffusion) acceptance counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verification steps (AR) / canvas evaluations (diffusion)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted:
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def take(self) -> SpecStats:
        """Return the counts so far and start over."""
        out = SpecStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = []
        return out
