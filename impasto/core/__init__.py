"""The engine core: requests, the paged KV-cache manager and the scheduler. Pure Python."""

from impasto.config.scheduler import SchedulerConfig
from impasto.core.kv_cache_manager import KVCacheManager
from impasto.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from impasto.core.request import Request, RequestStatus
from impasto.core.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "EngineCoreOutput",
    "KVCacheManager",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
