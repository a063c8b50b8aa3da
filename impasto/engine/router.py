"""Which data-parallel engine takes a request: prefix-aware (default), round-robin, least-loaded.

The prefix-aware router keeps, per engine, a model of that engine's prefix cache: the chained
block hashes (`core.hashing.chain_block_hashes`, the KV cache's own definition) of the prompts
it routed there, in LRU order, bounded by the engine's block count. A request goes to the engine
whose model holds the longest run of its leading blocks, unless the engines' loads are out of
balance, when it goes to the least loaded one (SGLang's cache-aware routing, in spirit).

Invariants:
- only live engines are chosen; `choose` raises `NoEngineError` when none is left;
- a choice never depends on anything but the prompt's tokens, the loads and earlier choices
  (no clocks, no randomness), so the same arrival order routes the same way;
- the cache model is a prediction: the engine may have evicted blocks (then the request is
  merely slower) or cached blocks the model lacks; outputs never depend on routing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from impasto.config.parallel import ParallelConfig
from impasto.core.hashing import chain_block_hashes

_DEFAULTS = ParallelConfig  # one place for the knobs' defaults (config/parallel.py)


class NoEngineError(RuntimeError):
    pass


@dataclass
class EngineLoad:
    """What the front end knows of one engine: alive, and its requests routed and not finished
    (running + waiting there)."""

    alive: bool = True
    in_flight: int = 0


@dataclass
class Choice:
    engine: int
    predicted_hit_blocks: int = 0  # leading blocks the cache model expected to be cached
    # The load balance overrode the cache: another engine was predicted to hold more of the
    # prompt (the request will recompute what it could have reused).
    overrode_cache: bool = False


class Router:
    name = "router"

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines

    def choose(
        self, token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[EngineLoad]
    ) -> Choice:
        raise NotImplementedError

    def forget_engine(self, index: int) -> None:
        """The engine died: nothing it cached is of use any more."""

    @staticmethod
    def _alive(loads: Sequence[EngineLoad]) -> list[int]:
        alive = [i for i, load in enumerate(loads) if load.alive]
        if not alive:
            raise NoEngineError("every engine is dead")
        return alive


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._next = 0

    def choose(self, token_ids, cache_salt, loads) -> Choice:
        alive = self._alive(loads)
        for step in range(self.num_engines):
            i = (self._next + step) % self.num_engines
            if i in alive:
                self._next = i + 1
                return Choice(i)
        raise AssertionError("unreachable: some engine is alive")


class LeastLoadedRouter(RoundRobinRouter):
    """The fewest requests in flight; ties in turn (so an idle fleet is filled evenly)."""

    name = "least_loaded"

    def choose(self, token_ids, cache_salt, loads) -> Choice:
        alive = self._alive(loads)
        least = min(loads[i].in_flight for i in alive)
        ties = [load if load.in_flight == least else EngineLoad(alive=False) for load in loads]
        return super().choose(token_ids, cache_salt, ties)


@dataclass
class _CacheModel:
    """One engine's predicted prefix cache: block hashes in LRU order (oldest first)."""

    capacity: int
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def match(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:  # a chain: block i can only hit if every block before it does
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class PrefixAwareRouter(LeastLoadedRouter):
    """Longest predicted cached prefix, unless loads are out of balance.

    Out of balance: the busiest live engine has more than `balance_abs` requests more than the
    idlest, and more than `balance_rel` times as many. Then the idlest takes the request (ties:
    the longer prefix). Otherwise the longest predicted prefix wins if it covers at least
    `cache_threshold` of the prompt's full blocks (ties: the less loaded); with no such prefix the
    request goes to the least loaded engine, with ties to the one whose cache model holds the
    fewest blocks (the most room for a new prefix).
    """

    name = "prefix_aware"

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        capacity_blocks: Sequence[int],
        balance_abs: int = _DEFAULTS.router_balance_abs_threshold,
        balance_rel: float = _DEFAULTS.router_balance_rel_threshold,
        cache_threshold: float = _DEFAULTS.router_cache_threshold,
    ) -> None:
        super().__init__(num_engines)
        self.block_size = block_size
        self.models = [_CacheModel(max(c, 1)) for c in capacity_blocks]
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.cache_threshold = cache_threshold

    def choose(self, token_ids, cache_salt, loads) -> Choice:
        alive = self._alive(loads)
        # The engine never hits its last prompt token (it must compute one to sample), so
        # neither does the prediction.
        hashes = chain_block_hashes(list(token_ids[:-1]), self.block_size, cache_salt)
        matches = {i: self.models[i].match(hashes) for i in alive}
        load = {i: loads[i].in_flight for i in alive}
        most, least = max(load.values()), min(load.values())
        best = max(matches.values())
        if most - least > self.balance_abs and most > self.balance_rel * least:
            pick = min(alive, key=lambda i: (load[i], -matches[i], i))
        else:
            if hashes and best > 0 and best >= self.cache_threshold * len(hashes):
                pick = min(alive, key=lambda i: (-matches[i], load[i], i))
            else:
                pick = min(alive, key=lambda i: (load[i], len(self.models[i].blocks), i))
        self.models[pick].insert(hashes)
        return Choice(pick, matches[pick], overrode_cache=matches[pick] < best)

    def forget_engine(self, index: int) -> None:
        self.models[index].blocks.clear()


def make_router(
    policy: str,
    num_engines: int,
    block_size: int,
    capacity_blocks: Sequence[int],
    balance_abs: int = _DEFAULTS.router_balance_abs_threshold,
    balance_rel: float = _DEFAULTS.router_balance_rel_threshold,
    cache_threshold: float = _DEFAULTS.router_cache_threshold,
) -> Router:
    if policy == "round_robin":
        return RoundRobinRouter(num_engines)
    if policy == "least_loaded":
        return LeastLoadedRouter(num_engines)
    if policy == "prefix_aware":
        return PrefixAwareRouter(
            num_engines, block_size, capacity_blocks, balance_abs, balance_rel, cache_threshold
        )
    raise ValueError(f"unknown routing policy {policy!r}")
