"""Chat with images on the tiny golden model (it has a vision tower): the first turn equals `generate`
over the same prompt with the same pixels; a text turn after it extends the cache that holds the
image's features; a later turn with an image prefills the conversation with every image once."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import k3jax
from k3jax.chat import ImagePart, UserMessage, encode_messages
from k3jax.chat.parsing import ReplyParser
from k3jax.chat.session import Chat
from k3jax.vision.processor import process_images
from tests.k3jax.chat.helpers import byte_tokenizer
from tests.k3jax.chat.test_session import CountingPrefill, FakeModelCalls, ScriptedChat

E = 258


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_an_image_turn_matches_generate_and_the_next_turn_extends(golden_model_fp32, monkeypatch):
    tok, counter = byte_tokenizer(), CountingPrefill(monkeypatch)
    image = picture(30, 20, 0)  # 14-pixel patches, padded to 56 x 28: a 2 x 4 grid, 2 features
    chat = Chat(golden_model_fp32, tok, thinking="high", max_new_tokens=4, temperature=0.0)
    first = chat.send("What is it?", images=[image])
    assert chat.messages[0] == UserMessage([ImagePart(30, 20), "What is it?"])
    prompt = encode_messages(tok, chat.messages[:1], thinking="high")
    pixel_values, grid_thws = process_images([image])
    out = k3jax.generate(golden_model_fp32, np.asarray([prompt], np.int32), max_new_tokens=4, stop_tokens=[E],
                         capacity=1024, on_token=lambda t: None, return_lengths=True, pixel_values=pixel_values,
                         grid_thws=grid_thws)
    assert first.token_ids == tuple(int(t) for t in np.asarray(out.tokens[0, : int(out.lengths[0])]))
    assert chat.cache_length == len(prompt) + len(first.token_ids) - 1 + (2 - 1)  # the placeholder: 2 positions

    second = chat.send("And?")
    assert len(counter.calls) == 1  # extended: no second prefill
    parser = ReplyParser(tok)
    parser.feed(second.token_ids)  # waiting for the next turn: its last token, and its closing if cut off
    assert chat.cache_length == len(chat.token_ids) - 1 - len(parser.closing_ids()) + (2 - 1)


def test_a_later_image_prefills_with_every_image(golden_model_fp32, monkeypatch):
    tok, calls = byte_tokenizer(), FakeModelCalls(monkeypatch, golden_model_fp32.config.vocab_size)
    chat = ScriptedChat(golden_model_fp32, tok, thinking=None, max_new_tokens=30, temperature=0.0,
                        replies=[k3jax.chat.AssistantMessage(text) for text in ("A", "B", "C", "D")])
    chat.send("Look", images=[picture(30, 20, 1)])   # 2 features
    chat.send("Text only")
    chat.send("And these", images=[picture(60, 60, 2), picture(30, 20, 3)])  # 60x60 -> 84x84: 3x3 = 9 features
    assert [c[2:] for c in calls.prefills] == [(1,), (3,)]  # first turn, then the turn with new images
    assert chat.cache_length == len(chat.token_ids) - 1 + (2 - 1) + (9 - 1) + (2 - 1)
    assert chat.token_ids == encode_messages(tok, chat.messages, thinking=None, add_generation_prompt=False)
    with pytest.raises(TypeError, match="images: expected a list of PIL images or file paths, got str"):
        chat.send("x", images="photo.png")
