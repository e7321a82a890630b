"""Streamed text with stop strings, and the prefix cache's lookup and eviction (no model runs)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from k3jax.model import ModelCache
from k3jax.nn.kda import KDACache
from k3jax.nn.mla import MLACache
from k3jax.serving.prefix_cache import SNAPSHOT_ALIGN, PrefixCache, restored
from k3jax.serving.text import StopMatcher, TextStream
from k3jax.tokenizer import ByteTokenizer


@pytest.mark.parametrize("pieces, stops, shown, text", [
    (["Hello", " wor", "ld"], [], ["Hello", " wor", "ld"], "Hello world"),
    (["Hel", "lo ST", "OP more"], ["STOP"], ["Hel", "lo ", ""], "Hello "),  # split across pieces, held back
    (["a S", "T", "x"], ["STOP"], ["a ", "", "STx"], "a STx"),  # a false start is released
    (["xxENDyySTOP"], ["STOP", "END"], ["xx"], "xx"),  # the earliest stop wins
    (["ab", "c"], ["bc", "abc"], ["", ""], ""),
])
def test_stop_matcher(pieces, stops, shown, text):
    matcher = StopMatcher(stops)
    assert [matcher.push(p) for p in pieces] == shown
    assert "".join(shown) + matcher.flush() == text == matcher.text


def test_text_stream_holds_split_characters_and_skips_specials():
    stream = TextStream(ByteTokenizer(eos_id=258, vocab_size=512), ["!"])
    euro = list("€".encode())
    out = [stream.push(t) for t in [ord("a"), *euro, 258, ord("b"), ord("!"), ord("c")]]
    assert out == ["a", "", "", "€", "", "b", "", ""] and stream.stopped and stream.text == "a€b"


def _row(length: int, fill: float) -> ModelCache:
    kda = KDACache(jnp.full((1, 2, 4, 4), fill), jnp.full((1, 3, 6), fill))
    mla = MLACache(jnp.full((1, 2 * SNAPSHOT_ALIGN, 8), fill))
    return ModelCache((kda,), (), (mla,), jnp.asarray(length, jnp.int32), jnp.zeros((1,), jnp.int32))


def test_prefix_cache_longest_proper_prefix_and_lru():
    one = _row(4, 1.0)
    # KDA state + conv + the latents kept (length rounded up to SNAPSHOT_ALIGN) + length + start
    size = 2 * 4 * 4 * 4 + 3 * 6 * 4 + SNAPSHOT_ALIGN * 8 * 4 + 4 + 4
    cache = PrefixCache(2 * size)
    assert cache.store([1, 2, 3, 4], one) and cache.store([1, 2], _row(2, 2.0))
    assert cache.lookup([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert cache.lookup([1, 2, 3, 4]).tokens == (1, 2)  # a proper prefix: one token is left to run
    assert cache.lookup([1, 3]) is None
    snap = cache.lookup([1, 2, 3, 4, 5])
    assert snap.cache.tail[0].latent.shape == (1, SNAPSHOT_ALIGN, 8)  # not the whole capacity
    back = restored(snap.cache, 4 * SNAPSHOT_ALIGN)
    assert back.tail[0].latent.shape == (1, 4 * SNAPSHOT_ALIGN, 8) and float(back.tail[0].latent[0, 3, 0]) == 1.0
    assert cache.store([7, 7, 7, 7], _row(4, 3.0))  # evicts the least recently used: [1, 2]
    assert cache.lookup([1, 2, 9]) is None and cache.lookup([1, 2, 3, 4, 9]) is not None
    assert cache.nbytes <= cache.budget_bytes and len(cache) == 2
    assert not PrefixCache(size - 1).store([1, 2, 3, 4], one)  # larger than the whole budget
