"""The persistent batch: per-row host buffers updated by diffs each step, not rebuilt.

Rows hold running requests. A finished or preempted request's row is filled by moving the
last row into it (the batch stays dense). Per step, the runner gathers the scheduled rows'
token ids, positions and slot mapping with vectorised numpy indexing.
"""

from __future__ import annotations

import numpy as np

from impasto.worker.request_state import RequestState


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        # Committed tokens plus this step's drafts / canvas (never beyond max_model_len).
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # committed tokens per row
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        self.states: list[RequestState] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, state: RequestState, block_ids: list[int], num_computed: int) -> None:
        """A new or resumed request: its whole block table and its computed tokens."""
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch full ({self.max_num_reqs} rows)")
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.row_of[state.req_id] = row
        self.append_blocks(row, block_ids)

    def remove(self, req_id: str) -> RequestState | None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return None
        state = self.states[row]
        last = len(self.req_ids) - 1
        if row != last:  # move the last row into the hole
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            nb = int(self.num_blocks[last])
            self.block_table[row, :nb] = self.block_table[last, :nb]
            for arr in (self.num_tokens, self.num_computed, self.num_blocks):
                arr[row] = arr[last]
            self.req_ids[row] = self.req_ids[last]
            self.states[row] = self.states[last]
            self.row_of[self.req_ids[row]] = row
        self.req_ids.pop()
        self.states.pop()
        return state

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        nb = int(self.num_blocks[row])
        self.block_table[row, nb : nb + len(block_ids)] = block_ids
        self.num_blocks[row] = nb + len(block_ids)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)
        self.states[row].output_token_ids.extend(token_ids)
