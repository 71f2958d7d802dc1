"""Continuous batching over shared KV blocks: an always-on ``Engine`` and its request/event types.

``Engine(manager, pool, runner, backend)`` serves ``Request`` objects: ``add`` any time, ``step``
in a loop (each returns the ``Event`` objects it produced), ``abort`` any time. ``BatchRun`` is that
loop run to completion for a list of prompts (``generate_batch``).
"""

from radixcache.engine.batch import BatchOutput, BatchRun, StreamToken
from radixcache.engine.engine import Engine
from radixcache.engine.request import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_PREFILLED,
                                       FINISH_REASONS, FINISH_STOP, Event, Request, SamplingParams)
from radixcache.engine.runner import EngineMetrics, ModelRunner

__all__ = ["BatchOutput", "BatchRun", "Engine", "EngineMetrics", "Event", "FINISH_ABORT", "FINISH_ERROR",
           "FINISH_LENGTH", "FINISH_PREFILLED", "FINISH_REASONS", "FINISH_STOP", "ModelRunner",
           "Request", "SamplingParams", "StreamToken"]
