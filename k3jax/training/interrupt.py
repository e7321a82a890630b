"""Ctrl-C during training, acted on between steps.

A step moves three things together: the data position (`next(stream)`), the trainer's state (its
buffers are donated to the step) and the step counter. A KeyboardInterrupt raised between any two of
them would checkpoint a state that does not match its counter or its data position, and the resumed
run would then differ from an uninterrupted one. So while training, SIGINT only notes the request;
the loop raises KeyboardInterrupt at the next step boundary, where all three agree.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class StepBoundaryInterrupt:
    """`with StepBoundaryInterrupt() as stop:` ... `stop.check()` between steps raises KeyboardInterrupt
    if Ctrl-C came. Outside the main thread (where Python cannot take signals) it changes nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "StepBoundaryInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
