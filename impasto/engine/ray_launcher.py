"""Engines as Ray actors (`--distributed-executor-backend ray`): the data-parallel engines of
one front end placed on a Ray cluster's nodes, each running the same engine loop as a local
engine process, connected to the front end over TCP.

Which cluster: with `RAY_ADDRESS` set, that one (an error if it cannot be reached); otherwise
a cluster already started on this machine with `ray start` (Ray's `address="auto"`); failing
both, a private single-node cluster for this process, on the loopback interface only, which
ends with it. Ray is imported here only, and only when this backend is chosen: it is an
optional extra (`pip install impasto[ray]`).

Placement: one placement group per front end, one bundle per engine (`{"CPU": its threads}`),
strategy SPREAD — engines on different nodes while there are nodes to spread over; with fewer
nodes than engines Ray packs the rest where they fit. Each engine is one actor in its bundle.

Invariants (those of `launcher.py`):
- `start` returns once the actor is created and its run call submitted; a placement the
  cluster cannot satisfy fails `start` within `PLACEMENT_TIMEOUT_S`, naming what is missing;
- `wait_exit` resolves when the actor's run call ends, or when the actor dies (its process
  killed, crashed, or its node lost), with a description; Ray never restarts an engine
  (`max_restarts=0`): a restarted engine would not know the requests the front end lost;
- `stop` waits for the run call to end (the front end sent `Shutdown`), then kills the actor;
  the last engine of a placement group to stop removes it. A front end that dies takes its
  actors with it (Ray ends the actors of a driver that is gone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from impasto.engine.launcher import EngineSpec

logger = logging.getLogger("impasto")

PLACEMENT_TIMEOUT_S = 120.0  # for the cluster to reserve every engine's CPUs
_LOOPBACK = "127.0.0.1"


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "--distributed-executor-backend ray needs Ray: pip install 'impasto[ray]'"
        ) from e
    return ray


@dataclass
class _State:
    owns_ray: bool = False  # this module called ray.init (and so calls ray.shutdown)


_STATE = _State()
_LOCK = threading.Lock()


def connect(num_cpus: int | None = None) -> None:
    """Connect this process to a Ray cluster, once (see the module docstring for which).

    `num_cpus`: the CPUs a private local cluster advertises (at least this machine's cores).
    """
    with _LOCK:
        ray = _ray()
        if ray.is_initialized():
            return
        address = _cluster_address()
        if address is None or _is_loopback(address):
            _single_node()
        if address is not None:
            _send_token_if_any()
        # ray.init installs its own SIGTERM handler in the main thread: the front end keeps
        # its own (it drains and stops its engines on SIGTERM).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        try:
            if address is not None:
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                cpus = max(os.cpu_count() or 1, num_cpus or 1)
                logger.info("ray: no cluster to join; a local one (%d CPUs, loopback only)", cpus)
                ray.init(
                    _node_ip_address=_LOOPBACK,
                    num_cpus=cpus,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                )
            _STATE.owns_ray = True
        finally:
            if main and previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _cluster_address() -> str | None:
    """RAY_ADDRESS, else the cluster `ray start` runs on this machine, else None (start one):
    the order `ray.init()` follows, asked first to know whether the cluster is loopback-only."""
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env
    from ray._private import services

    try:
        return services.get_ray_address_from_environment("auto", None)
    except ConnectionError:  # none runs here
        return None


def _send_token_if_any() -> None:
    """Authenticate to an existing cluster with the token `ray start` wrote, when there is one.

    `ray start` enables token authentication by default and saves the token (to
    ~/.ray/auth_token); a driver with `RAY_AUTH_MODE` unset does not send it and is refused.
    Sending a token to a cluster that does not check tokens is harmless, so with a token at
    hand and the mode unset, send it (an explicit `RAY_AUTH_MODE` is left as it is)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(path):
        os.environ["RAY_AUTH_MODE"] = "token"
        # Ray caches its config at import: refresh it so this process sees token mode too.
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()


def _is_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _single_node() -> None:
    """Keep Ray on 127.0.0.1: Ray replaces a loopback address by the machine's own unless it
    is told the cluster has a single node (the flag Ray reads for that, set for this process
    and the Ray processes it starts; with a 127.0.0.1 address they listen on loopback only)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def front_end_host() -> str:
    """The address engines reach the front end at: this node's IP as Ray knows it (on a
    single-node cluster on loopback, 127.0.0.1). Connects to the cluster first."""
    connect()
    return str(_ray().util.get_node_ip_address())


# -- placement groups, shared by the engines of one front end ---------------------------------
@dataclass
class _Group:
    num_engines: int
    threads: int
    pg: Any = None
    started: set[int] = field(default_factory=set)  # engine indices that joined
    live: set[int] = field(default_factory=set)  # joined and not stopped


_OPEN: dict[int, _Group] = {}  # num_engines -> the group engines of a starting front end join
_LIVE: list[_Group] = []  # groups with an engine not stopped


def _join(spec: EngineSpec, threads: int) -> _Group:
    """The placement group for this engine: the one its front end's first engine created
    (engines start in index order), or a new one. Waits until the cluster reserved it."""
    ray = _ray()
    from ray.util.placement_group import placement_group

    n = spec.num_engines
    group = _OPEN.get(n)
    if group is None or spec.index in group.started:  # another front end's (or none)
        group = _Group(n, threads)
        bundles = [{"CPU": float(threads)} for _ in range(n)]
        group.pg = placement_group(bundles, strategy="SPREAD")
        try:
            ray.get(group.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group.pg)
            have = ray.cluster_resources().get("CPU", 0)
            raise RuntimeError(
                f"the Ray cluster could not place {n} engine(s) of {threads} CPU(s) each within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (it has {have:g} CPUs in all; set --num-threads "
                "per engine, or add nodes)"
            ) from None
        _OPEN[n] = group
        _LIVE.append(group)
    group.started.add(spec.index)
    group.live.add(spec.index)
    if len(group.started) == n:  # full: a later front end makes its own
        _OPEN.pop(n, None)
    return group


def _leave(group: _Group, index: int) -> None:
    """This engine stopped; the last of its group removes the placement group (and, when no
    group is left and this module connected to Ray, disconnects)."""
    if index not in group.live:
        return
    group.live.discard(index)
    if group.live:
        return
    if _OPEN.get(group.num_engines) is group:
        del _OPEN[group.num_engines]
    if group in _LIVE:
        _LIVE.remove(group)
    ray = _ray()
    try:
        ray.util.remove_placement_group(group.pg)
    except Exception as e:  # noqa: BLE001 - the cluster may be gone already
        logger.warning("ray: could not remove the placement group: %s", e)
    if not _LIVE and _STATE.owns_ray:
        ray.shutdown()  # a private local cluster ends here
        _STATE.owns_ray = False


# -- the actor -------------------------------------------------------------------------------
class ImpastoEngine:
    """The Ray actor: one engine, its loop run by `run` until it is told to stop."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: EngineSpec) -> None:
        from impasto.engine.engine_process import run_engine_process

        # Ray owns the process: no orphan check (the actor dies with its front end), no
        # signal handlers (Ray's own stop the worker), no pinning (the node's cores are Ray's).
        run_engine_process(
            spec.args, spec.input_addr, spec.output_addr, None, spec.log_level, None, False
        )


def describe_death(error: BaseException) -> str:
    """A short description of how a Ray actor ended, from Ray's error."""
    text = str(error)
    kind = re.search(r"Worker exit type: (\S+)", text)
    detail = re.search(r"Worker exit detail: (.*?)(?:\.\s|\.?$)", text, re.M)
    if kind or detail:
        facts = [f"exit type {kind.group(1)}" if kind else "", detail.group(1) if detail else ""]
        return f"Ray actor died: {'; '.join(f for f in facts if f)}"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"Ray actor died: {first}"


class RayLauncher:
    """One engine as a Ray actor in its bundle of the front end's placement group."""

    transport = "tcp"  # the engine may run on another node

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._pid: int | None = None
        self._pid_ref: Any = None
        self._actor: Any = None
        self._done: concurrent.futures.Future | None = None
        self._group: _Group | None = None

    @property
    def pid(self) -> int | None:
        """The actor process's pid, once Ray has started it (None before)."""
        if self._pid is None and self._pid_ref is not None:
            ray = _ray()
            ready, _ = ray.wait([self._pid_ref], timeout=0)
            if ready:
                try:
                    self._pid = int(ray.get(self._pid_ref))
                except ray.exceptions.RayError:
                    self._pid_ref = None  # the actor died before it answered
        return self._pid

    @pid.setter
    def pid(self, value: int | None) -> None:
        self._pid = value

    def start(self) -> None:
        s = self.spec
        threads = s.args.num_threads or 1
        connect(num_cpus=threads * s.num_engines)
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._group = group = _join(s, threads)
        actor_cls = ray.remote(ImpastoEngine)
        try:
            self._actor = actor_cls.options(
                num_cpus=threads,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group.pg, placement_group_bundle_index=s.index
                ),
            ).remote()
            # Actor calls run in submission order: the pid first, then the engine loop.
            self._pid_ref = self._actor.pid.remote()
            self._done = self._actor.run.remote(s).future()
        except BaseException:
            _leave(group, s.index)
            raise
        logger.info(
            "ray: engine %d of %d placed (bundle %d, %d CPU(s))",
            s.index,
            s.num_engines,
            s.index,
            threads,
        )

    def is_alive(self) -> bool:
        return self._done is not None and not self._done.done()

    async def wait_exit(self) -> str:
        assert self._done is not None, "start() first"
        try:
            await asyncio.wrap_future(self._done)
        except Exception as e:  # noqa: BLE001 - any way the call ended is a description
            ray = _ray()
            if isinstance(e, ray.exceptions.RayActorError):
                return describe_death(e)
            return f"the engine's run call failed: {type(e).__name__}: {str(e)[:300]}"
        return "the engine's run call ended"

    async def stop(self, timeout_s: float) -> None:
        """Wait for the run call to end (it was told to), then kill the actor."""
        if self._actor is None:
            return
        done = self._done
        if done is not None and not done.done():
            try:
                await asyncio.wait_for(asyncio.wrap_future(done), timeout_s)
            except Exception:  # noqa: BLE001 - timed out or died: it is killed below
                pass
        ray = _ray()
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - dead already, or the cluster is gone
            logger.debug("ray: kill of engine %d: %s", self.spec.index, e)
        self._actor = None
        if self._group is not None:
            group, self._group = self._group, None
            _leave(group, self.spec.index)
