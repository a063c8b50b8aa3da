"""The data-parallel router: prefix-aware routing keeps a prefix on one engine, gives way to
load when the engines are out of balance, never picks a dead engine; round-robin and
least-loaded; the core split between engines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impasto.engine.dp_client import split_cores
from impasto.engine.router import (
    EngineLoad,
    LeastLoadedRouter,
    NoEngineError,
    PrefixAwareRouter,
    RoundRobinRouter,
    make_router,
)

BS = 4


def prompt(prefix: int, suffix: int, prefix_len: int = 12) -> list[int]:
    return [prefix * 100 + i for i in range(prefix_len)] + [7000 + suffix, 7001 + suffix]


def loads(*in_flight: int) -> list[EngineLoad]:
    return [EngineLoad(True, n) for n in in_flight]


def test_prefix_sticks_to_one_engine_and_prefixes_spread():
    r = PrefixAwareRouter(2, BS, [1000, 1000])
    state = loads(0, 0)
    where: dict[int, set[int]] = {}
    for q in range(6):
        for p in range(4):  # 4 system prompts, interleaved arrivals
            c = r.choose(prompt(p, q), None, state)
            where.setdefault(p, set()).add(c.engine)
            if q > 0:
                assert c.predicted_hit_blocks == 3  # the 12-token prefix: 3 blocks of 4
    assert all(len(engines) == 1 for engines in where.values()), where
    assert {next(iter(e)) for e in where.values()} == {0, 1}  # new prefixes fill both engines


def test_imbalance_goes_to_the_least_loaded():
    r = PrefixAwareRouter(2, BS, [1000, 1000], balance_abs=4, balance_rel=1.5)
    first = r.choose(prompt(1, 0), None, loads(0, 0)).engine
    busy = [0, 0]
    busy[first] = 10
    assert r.choose(prompt(1, 1), None, loads(*busy)).engine == 1 - first
    # Both engines now hold the prefix: the less loaded one takes the next.
    assert r.choose(prompt(1, 2), None, loads(*busy)).engine == 1 - first
    second = r.choose(prompt(2, 0), None, loads(0, 0)).engine
    busy = [0, 0]
    busy[second] = 3  # within the bounds: the engine holding the prefix takes it
    assert r.choose(prompt(2, 1), None, loads(*busy)).engine == second


def test_override_is_flagged_only_against_the_cache():
    r = PrefixAwareRouter(2, BS, [1000, 1000], balance_abs=4, balance_rel=1.5)
    first = r.choose(prompt(1, 0), None, loads(0, 0))
    assert not first.overrode_cache  # a new prefix: nobody held more
    busy = [0, 0]
    busy[first.engine] = 10
    moved = r.choose(prompt(1, 1), None, loads(*busy))
    assert moved.engine == 1 - first.engine and moved.overrode_cache
    # Now both hold it: the idler one is also a cache choice, no override.
    assert not r.choose(prompt(1, 2), None, loads(*busy)).overrode_cache


def test_thresholds_decide_balance_and_cache():
    # abs 16: 10 in flight beyond the idlest is tolerated, the prefix's engine keeps it.
    r = PrefixAwareRouter(2, BS, [1000, 1000], balance_abs=16, balance_rel=1.5)
    e = r.choose(prompt(1, 0), None, loads(0, 0)).engine
    busy = [0, 0]
    busy[e] = 10
    assert r.choose(prompt(1, 1), None, loads(*busy)).engine == e
    busy[e] = 17
    assert r.choose(prompt(1, 2), None, loads(*busy)).engine == 1 - e
    # rel: 20 against 12 is beyond abs 4 but within 2x, so the cache decides.
    r = PrefixAwareRouter(2, BS, [1000, 1000], balance_abs=4, balance_rel=2.0)
    e = r.choose(prompt(1, 0), None, loads(0, 0)).engine
    busy = [12, 12]
    busy[e] = 20
    assert r.choose(prompt(1, 1), None, loads(*busy)).engine == e
    # cache_threshold: a cached prefix of 3 of the prompt's 4 full blocks decides at 0.75,
    # not at 0.8 (then the less loaded engine takes it).
    long_prompt = [1 * 100 + i for i in range(12)] + [9000, 9001, 9002, 9003, 9004]
    for threshold, stays in ((0.75, True), (0.8, False)):
        r = PrefixAwareRouter(2, BS, [1000, 1000], cache_threshold=threshold)
        e = r.choose(prompt(1, 0), None, loads(0, 0)).engine
        busy = [0, 0]
        busy[e] = 1
        assert (r.choose(long_prompt, None, loads(*busy)).engine == e) is stays


def test_make_router_takes_the_config_thresholds():
    from impasto.config.engine_args import EngineArgs

    p = EngineArgs(
        model="m", data_parallel_size=2, router_balance_abs_threshold=9,
        router_balance_rel_threshold=2.5, router_cache_threshold=0.6,
    ).parallel_config()  # fmt: skip
    r = make_router(
        "prefix_aware", 2, BS, [10, 10], p.router_balance_abs_threshold,
        p.router_balance_rel_threshold, p.router_cache_threshold,
    )  # fmt: skip
    assert isinstance(r, PrefixAwareRouter)
    assert (r.balance_abs, r.balance_rel, r.cache_threshold) == (9, 2.5, 0.6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("router_balance_abs_threshold", -1),
        ("router_balance_abs_threshold", 2.5),
        ("router_balance_rel_threshold", 0.9),
        ("router_balance_rel_threshold", "2"),
        ("router_cache_threshold", 1.5),
        ("router_cache_threshold", -0.1),
    ],
)
def test_bad_thresholds_are_refused_by_name(field, value):
    from impasto.config.parallel import ParallelConfig
    from impasto.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as e:
        ParallelConfig(data_parallel_size=2, **{field: value})
    assert e.value.param == field


def test_lru_capacity_forgets_old_prefixes():
    r = PrefixAwareRouter(1, BS, [3])
    r.choose(prompt(1, 0), None, loads(0))
    r.choose(prompt(2, 0), None, loads(0))  # evicts prefix 1's blocks (capacity 3 blocks)
    assert r.choose(prompt(1, 1), None, loads(0)).predicted_hit_blocks == 0


def test_dead_engine_is_never_chosen_and_forgotten():
    r = PrefixAwareRouter(2, BS, [100, 100])
    e = r.choose(prompt(1, 0), None, loads(0, 0)).engine
    state = loads(0, 0)
    state[e].alive = False
    r.forget_engine(e)
    assert r.choose(prompt(1, 1), None, state).engine == 1 - e
    state[1 - e].alive = False
    with pytest.raises(NoEngineError):
        r.choose(prompt(1, 2), None, state)


def test_round_robin_and_least_loaded():
    rr = RoundRobinRouter(3)
    assert [rr.choose([1], None, loads(0, 0, 0)).engine for _ in range(4)] == [0, 1, 2, 0]
    dead_middle = [EngineLoad(True, 0), EngineLoad(False, 0), EngineLoad(True, 0)]
    assert {rr.choose([1], None, dead_middle).engine for _ in range(4)} == {0, 2}
    ll = LeastLoadedRouter(3)
    assert ll.choose([1], None, loads(5, 2, 9)).engine == 1
    assert sorted(ll.choose([1], None, loads(1, 1, 1)).engine for _ in range(3)) == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["prefix_aware", "round_robin", "least_loaded"]),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 5), min_size=1, max_size=20),  # prompt
            st.lists(st.booleans(), min_size=3, max_size=3),  # which engines are alive
            st.lists(st.integers(0, 30), min_size=3, max_size=3),  # their loads
        ),
        max_size=30,
    ),
)
def test_choice_is_alive_and_deterministic(policy, steps):
    """Every choice is a live engine, and the same history routes the same way."""
    a, b = (make_router(policy, 3, BS, [8, 8, 8]) for _ in range(2))
    for tokens, alive, in_flight in steps:
        state = [EngineLoad(al, n) for al, n in zip(alive, in_flight, strict=True)]
        if not any(alive):
            with pytest.raises(NoEngineError):
                a.choose(tokens, None, state)
            continue
        ca, cb = a.choose(tokens, None, state), b.choose(tokens, None, state)
        assert ca == cb
        assert state[ca.engine].alive


def test_split_cores():
    assert split_cores([0, 1], 2) == [(0,), (1,)]
    assert split_cores([0, 1, 2, 3, 4], 2) == [(0, 1, 2), (3, 4)]
    assert split_cores([0], 2) == [None, None]  # fewer cores than engines: nobody pinned
