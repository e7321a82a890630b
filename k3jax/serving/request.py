"""What a request to the engine is, how it ends, and where its results go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import numpy as np


class QueueFull(Exception):
    """The waiting queue is full (the server answers 503)."""


class ShuttingDown(Exception):
    """The scheduler no longer takes requests."""


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: the prompt ids, the token budget and the sampler settings."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()


class Finish(NamedTuple):
    reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache
    error: str | None = None


class Sink(Protocol):
    """Where a request's results go; called from the engine thread, so it must not block."""

    def token(self, token: int) -> None: ...
    def finish(self, finish: Finish) -> None: ...


class Handle:
    """A submitted request; `cancel()` frees its slot at the engine's next step boundary."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel


@dataclass(eq=False)
class EngineRequest:
    """A request inside the engine: where its tokens go, its sampling keys, what it has generated, its slot."""

    req: GenerationRequest
    sink: Sink
    submitted: float
    keys: np.ndarray | None = None
    generated: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0
    cancelled: bool = False
    finished: bool = False
