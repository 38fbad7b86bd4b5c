"""Admission and lifecycle of requests; pure Python, no mlx import."""

from omlx.scheduler.request import (
    Request,
    RequestStatus,
    RequestUpdate,
    SamplingParams,
    TokenLogprob,
    TokenOutput,
)
from omlx.scheduler.scheduler import Scheduler

__all__ = [
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "Scheduler",
    "TokenLogprob",
    "TokenOutput",
]
