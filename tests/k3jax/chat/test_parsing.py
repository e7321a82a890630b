"""Parsing replies written from the grammar (and the encoder's own renderings) back into reasoning,
content and typed tool calls; truncation at every token never raises; streaming says each piece's channel."""

from __future__ import annotations

import re

import pytest

from k3jax.chat import AssistantMessage, RawArguments, ToolCall, encode_for_training
from k3jax.chat.parsing import ReplyParser, parse_reply
from tests.k3jax.chat.helpers import bpe_tokenizer, byte_tokenizer, xtml

CALL = ('<|open|>tools<|sep|><|open|>call¦ tool="weather"¦ index="1"<|sep|>'
        '<|open|>argument¦ key="city"¦ type="string"<|sep|>Paris, "FR"<|close|>argument<|sep|>'
        '<|open|>argument¦ key="days"¦ type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|open|>argument¦ key="opts"¦ type="object"<|sep|>{"a": [1, null, true]}<|close|>argument<|sep|>'
        '<|close|>call<|sep|><|open|>call¦ tool="a&amp;b &quot;x&quot;"¦ index="2"<|sep|>'
        '<|open|>json¦ type="object"<|sep|>{oops<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
REPLY = ("Let me think. 你好<|close|>think<|sep|><|open|>response<|sep|>It is sunny.<|close|>response<|sep|>"
         + CALL + "<|close|>message<|sep|><|end_of_msg|>")
CALLS = (ToolCall("weather", {"city": 'Paris, "FR"', "days": 3, "opts": {"a": [1, None, True]}}),
         ToolCall('a&b "x"', RawArguments("{oops")))


@pytest.fixture(scope="module", params=["bpe", "byte"])
def tok(request):
    return bpe_tokenizer() if request.param == "bpe" else byte_tokenizer()


def test_full_reply(tok):
    reply = parse_reply(tok, xtml(tok, REPLY))
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("Let me think. 你好", "It is sunny.", CALLS)
    assert reply.finished and reply.errors == ()
    assert reply.to_message() == AssistantMessage("It is sunny.", "Let me think. 你好", CALLS)


def test_without_thinking_the_reply_starts_in_the_response(tok):
    ids = xtml(tok, "Sure.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    reply = parse_reply(tok, ids, thinking=False)
    assert (reply.reasoning, reply.content, reply.finished, reply.errors) == ("", "Sure.", True, ())


def test_round_trip_with_the_training_encoding(tok):
    """The encoder's targets of an assistant turn are exactly what the parser reads back."""
    message = AssistantMessage("Done.", "Check the \"weather\" & <|open|> the time.", CALLS)
    ids, mask = encode_for_training(tok, [message])
    reply = parse_reply(tok, [i for i, m in zip(ids, mask) if m])
    assert reply.to_message() == message and reply.finished and reply.errors == ()


def test_truncation_anywhere_never_raises(tok):
    ids = xtml(tok, REPLY)
    for cut in range(len(ids) + 1):
        reply = parse_reply(tok, ids[:cut])
        assert "Let me think. 你好".startswith(reply.reasoning.rstrip("\ufffd"))
        assert reply.finished == (cut == len(ids))
        assert len(reply.tool_calls) <= 2
    cut_in_think = parse_reply(tok, xtml(tok, "Let me"))
    assert (cut_in_think.reasoning, cut_in_think.content, cut_in_think.tool_calls) == ("Let me", "", ())
    cut_in_call = parse_reply(tok, xtml(tok, REPLY[:REPLY.index("{oops")]))
    assert cut_in_call.tool_calls == CALLS[:1] and "cut off inside tool call" in cut_in_call.errors[-1]


def test_streaming_channels_and_split_characters(tok):
    parser = ReplyParser(tok)
    pieces = []
    for i in xtml(tok, REPLY):
        pieces += parser.feed([i])
    by_channel = {}
    for channel, text in pieces:
        by_channel[channel] = by_channel.get(channel, "") + text
    assert by_channel == {"reasoning": "Let me think. 你好", "content": "It is sunny.",
                          "tool": 'Paris, "FR"3{"a": [1, null, true]}{oops'}
    assert all("\ufffd" not in text for _, text in pieces)  # 你 and 好 span several byte tokens
    assert parser.result() == parse_reply(tok, xtml(tok, REPLY))


def test_result_mid_stream_leaves_the_parser_going():
    tok = byte_tokenizer()
    parser = ReplyParser(tok)
    ids = xtml(tok, "你好")
    parser.feed(ids[:2])  # inside the first character
    assert parser.result().reasoning == "\ufffd"
    assert parser.feed(ids[2:]) == [("reasoning", "你"), ("reasoning", "好")]
    assert parser.result().reasoning == "你好"
    parser.feed(ids[:1])
    assert parser.flush() == [("reasoning", "\ufffd")] and parser.result().reasoning == "你好\ufffd"


@pytest.mark.parametrize("reply, expected, error", [
    ("a<|open|>response<|sep|>b<|close|>message<|sep|><|end_of_msg|>", ("a", "b"), r"<think> left open by <response>"),
    ("a<|open|>call<|sep|>b", ("ab", ""), r"unexpected tag <call> inside <think>"),
    ('r<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|><|open|>tools<|sep|><|open|>call¦ tool="f"<|sep|>'
     '<|open|>argument¦ key="n"¦ type="number"<|sep|>many<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
     '<|close|>message<|sep|><|end_of_msg|>', ("r", "c"), r"argument 'n': argument of type number is not JSON"),
    ("r<|close|>think<|sep|>stray<|open|>response<|sep|>c<|end_of_msg|>x", ("r", "c"), r"text outside any channel"),
    ("r<|sep|>s<|close|>think", ("rs", ""), r"<\|sep\|> outside a tag"),
    ("r<|media_pad|>s", ("rs", ""), r"special token \d+ where text belongs"),
    ("r<|close|>response<|sep|>", ("r", ""), r"closing tag </response> with no open <response>"),
])
def test_malformed_replies_are_noted_not_raised(tok, reply, expected, error):
    parsed = parse_reply(tok, xtml(tok, reply))
    assert (parsed.reasoning, parsed.content) == expected
    assert any(re.search(error, e) for e in parsed.errors), parsed.errors


def test_typed_values_that_do_not_match_their_type_stay_text():
    tok = byte_tokenizer()
    reply = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
             '<|open|>call¦ tool="f"¦ index="1"<|sep|><|open|>argument¦ key="b"¦ type="boolean"<|sep|>1<|close|>argument<|sep|>'
             '<|open|>argument¦ key="n"¦ type="number"<|sep|>true<|close|>argument<|sep|>'
             '<|open|>argument¦ key="s"¦ type="string"<|sep|>null<|close|>argument<|sep|><|close|>call<|sep|>')
    parsed = parse_reply(tok, xtml(tok, reply))
    assert parsed.tool_calls == (ToolCall("f", {"b": "1", "n": "true", "s": "null"}),)
    assert len(parsed.errors) == 2 and not parsed.finished


@pytest.mark.parametrize("thinking", [True, False])
def test_closing_ids_end_a_cut_reply_as_a_whole_message(tok, thinking):
    reply = REPLY if thinking else REPLY[REPLY.index("It is sunny"):]
    ids = xtml(tok, reply)
    c = ReplyParser(tok).c
    for cut in range(len(ids) + 1):
        parser = ReplyParser(tok, thinking=thinking)
        parser.feed(ids[:cut])
        before = parser.result()
        closed = parse_reply(tok, ids[:cut] + parser.closing_ids(), thinking=thinking)
        assert closed.finished and closed.reasoning == before.reasoning
        in_tag = ids[:cut].count(c.open) + ids[:cut].count(c.close) > ids[:cut].count(c.sep)
        if not in_tag and "call" not in parser.stack:  # cut outside tags and calls: nothing malformed
            assert closed.errors == () and closed.content == before.content
    assert parse_reply(tok, xtml(tok, "")).finished is False
    parser = ReplyParser(tok)
    assert tok.decode(parser.closing_ids()) == (
        "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
