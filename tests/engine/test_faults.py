"""Faults injected into the model runner under load: an exception (inside the forward, and
before the runner saw the step), NaN / inf logits, a step that hangs past the watchdog's
deadline. Each run is compared with a fault-free run of the same workload:

- the requests the faults hit finish with an error (all of a raising / hung step's requests;
  exactly the owner of the poisoned row for NaN / inf), and no other request does;
- every other request finishes token-identical to the fault-free run;
- the engine goes on, and at the end no KV block and no runner row is left behind.

The workload: staggered arrivals, shared prefixes (prefix-cache hits), greedy and seeded
random sampling (batch-invariant), a KV pool small enough to preempt.
"""

from __future__ import annotations

import random
import time

import pytest

from impasto.config import EngineArgs
from impasto.engine.engine import DEAD_AFTER_TIMEOUTS, EngineDeadError, LLMEngine
from impasto.sampling_params import SamplingParams
from impasto.testing import Arrival, FaultInjector, WorkloadResult, run_workload

from ..entrypoints.conftest import build_checkpoint

NUM_BLOCKS = 24
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def _workload(n: int = 24, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 160) for _ in range(9)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 160) for _ in range(rng.randrange(1, 14))]
        prompt = shared + tail if i % 2 else tail + shared
        if i % 4 == 0:  # a repeating pattern: the n-gram proposer finds drafts
            prompt = (prompt[:4] * 4)[: rng.randrange(6, 17)]
        if i % 3:
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(6, 15), ignore_eos=True
            )
        else:
            params = SamplingParams(
                temperature=0.9, top_p=0.9, seed=i, max_tokens=rng.randrange(6, 15), ignore_eos=True
            )
        out.append(Arrival(i // 4, f"r{i}", prompt, params))
    return out


def _engine(path, **kwargs) -> LLMEngine:
    args = dict(
        model=str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=4,
        max_num_seqs=6,
        max_model_len=48,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=NUM_BLOCKS,
        enable_prefix_caching=True,
    )
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("faults"), "llama")


@pytest.fixture(scope="module", params=["plain", "ngram"])
def spec(request):
    return {"plain": None, "ngram": NGRAM}[request.param]


@pytest.fixture(scope="module")
def reference(checkpoint, spec) -> WorkloadResult:
    ref = run_workload(_engine(checkpoint, speculative_config=spec), _workload())
    assert set(ref.reasons.values()) == {"length"}
    assert ref.metrics["impasto:num_preemptions"] > 0, "the pool should be tight enough"
    assert ref.metrics["impasto:prefix_cache_hits"] > 0
    return ref


@pytest.mark.parametrize("kind", ["raise", "raise_before_update", "nan", "inf", "hang"])
def test_faults_fail_only_their_requests(checkpoint, spec, reference, kind):
    rng = random.Random(sum(map(ord, kind)))
    steps = sorted(rng.sample(range(2, reference.steps // 3), 3))
    timeout = 0.4 if kind == "hang" else None
    engine = _engine(checkpoint, speculative_config=spec, step_timeout_s=timeout)
    injector = FaultInjector(engine.runner, kind, steps, hang_s=2.5 * 0.4, seed=len(steps))
    got = run_workload(engine, _workload())
    injector.uninstall()

    failed = {rid for rid, reason in got.reasons.items() if reason == "error"}
    assert len(injector.hit) == 3
    if kind in ("nan", "inf"):
        # one request per poisoned row: its owner, among that step's requests
        assert len(failed) == 3 and failed <= set().union(*injector.hit)
        assert all(hit & failed for hit in injector.hit)
    else:
        assert failed == set().union(*injector.hit)
    for rid, tokens in reference.tokens.items():
        if rid not in failed:
            assert got.reasons[rid] == "length", rid
            assert tokens == got.tokens[rid], f"{rid} diverged from the fault-free run"
    assert got.metrics["impasto:request_failure"] == len(failed)
    assert got.metrics["impasto:step_failed_requests"] == len(failed)
    assert got.metrics["impasto:step_timeouts"] == (3 if kind == "hang" else 0)


def test_a_step_that_never_returns_makes_the_engine_dead(checkpoint):
    """Past the grace, the engine says it is dead (the server process exits on it)."""
    timeout = 0.2
    engine = _engine(checkpoint, step_timeout_s=timeout)
    injector = FaultInjector(engine.runner, "hang", [1], hang_s=float("inf"))
    for a in _workload(6):
        engine.add_request(a.rid, {"prompt_token_ids": a.prompt}, a.params)
    failed: set[str] = set()
    start = None
    try:
        with pytest.raises(EngineDeadError):
            for _ in range(10_000):
                for out in engine.step():
                    if out.finished and out.outputs[0].finish_reason == "error":
                        failed.add(out.request_id)
                        start = start or time.monotonic()
        assert start is not None
        dead_after = time.monotonic() - start
        assert dead_after >= DEAD_AFTER_TIMEOUTS * timeout * 0.9
        assert failed == injector.hit[0]
        assert engine.get_metrics() and engine.metrics.counters["impasto:step_timeouts"] == 1
    finally:
        injector.release()
    assert engine.watchdog.wait_released(5.0)  # the thread ends once released


def test_engine_loop_fails_everything_then_exits_when_the_engine_is_dead():
    """The engine process: every request in flight gets its error before the loop ends."""
    import zmq

    from impasto.engine import ipc
    from impasto.engine.engine_process import EngineLoop

    class DeadEngine:
        def __init__(self) -> None:
            self.aborted: list[str] = []

        def has_unfinished_requests(self) -> bool:
            return True

        def step(self):
            raise EngineDeadError("a model step does not return")

        def abort_request(self, ids: list[str]) -> None:
            self.aborted += ids

    ctx = zmq.Context()
    pull, push, sink = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    engine = DeadEngine()
    loop = EngineLoop(engine, pull, push, parent_pid=0)
    loop.streams = {"a", "b"}
    try:
        with pytest.raises(EngineDeadError):
            loop._step()
        msg = ipc.decode_output(sink.recv())
        assert isinstance(msg, ipc.Outputs)
        assert sorted(e.request_id for e in msg.errors) == ["a", "b"]
        assert all(e.status == 500 and "does not return" in e.message for e in msg.errors)
        assert sorted(engine.aborted) == ["a", "b"]
    finally:
        for sock in (pull, push, sink):
            sock.close(linger=0)
        ctx.term()


def test_step_timeout_argument():
    assert EngineArgs(step_timeout_s=0).step_timeout_s is None  # 0: no deadline
    assert EngineArgs().step_timeout_s == 300.0
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="step_timeout_s"):
            EngineArgs(step_timeout_s=bad)


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_the_model_is_built_on_the_thread_its_steps_run_on(checkpoint, monkeypatch, timeout):
    """With a deadline, steps run on the watchdog's thread, and so does building the model:
    the caller's thread then runs no OpenMP parallel region, which would make every region of
    the step thread pay a kernel wake-up (step_watchdog.py). Without one, both are inline."""
    import threading

    import impasto.engine.engine as engine_module

    threads: dict[str, int] = {}
    build = engine_module.build_components

    def recording_build(args):
        threads["build"] = threading.get_ident()
        return build(args)

    monkeypatch.setattr(engine_module, "build_components", recording_build)
    engine = _engine(checkpoint, step_timeout_s=timeout)
    execute = engine.runner.execute_model

    def recording_execute(so):
        threads["step"] = threading.get_ident()
        return execute(so)

    engine.runner.execute_model = recording_execute
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert threads["build"] == threads["step"]
    assert (threads["step"] == threading.get_ident()) == (timeout is None)
