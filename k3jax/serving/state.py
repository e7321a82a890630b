"""The server's state, as the routes see it."""

from __future__ import annotations

from dataclasses import dataclass

from k3jax.serving.scheduler import Scheduler
from k3jax.tokenizer import Tokenizer


@dataclass
class ServerState:
    """What the routes need: the engine, the tokenizers, and the limits requests are checked against."""

    scheduler: Scheduler
    tokenizer: Tokenizer
    chat_tokenizer: Tokenizer | None  # the tokenizer with K3's control tokens named; None: no chat endpoint
    model_name: str
    vocab_size: int
    max_len: int
    eos_id: int | None
    bos_id: int | None
    created: int
