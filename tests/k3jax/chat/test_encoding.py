"""The chat encoding reproduces the format's grammar token for token (expected ids written as the
rendered string, see helpers.xtml), with a BPE whose merges make piece boundaries visible."""

from __future__ import annotations

import json

import pytest

from k3jax.chat import (
    AssistantMessage, ImagePart, NewTools, RawArguments, ResponseFormat, SystemMessage, Tool, ToolCall, ToolMessage,
    UserMessage, encode_for_training, encode_messages, messages_from_dicts, tools_from_dicts,
)
from tests.k3jax.chat.helpers import bpe_tokenizer, byte_tokenizer, xtml

EFFORT = ('<|open|>message¦ role="system"¦ type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think '
          "in your thinking channel (not including the response channel), supported values include `low`, `medium`, "
          "`high`, and `max`.\nNow the system is invoked with `thinking_effort={}`.<|close|>message<|sep|><|end_of_msg|>")
USER_HI = '<|open|>message¦ role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
GEN_THINK = '<|open|>message¦ role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESPONSE = '<|open|>message¦ role="assistant"<|sep|><|open|>response<|sep|>'


@pytest.fixture(scope="module", params=["bpe", "byte"])
def tok(request):
    return bpe_tokenizer() if request.param == "bpe" else byte_tokenizer()


def test_user_turn_and_generation_prompt_default_thinking_max(tok):
    ids = encode_messages(tok, [UserMessage("Hi")])
    assert ids == xtml(tok, EFFORT.format("max") + USER_HI + GEN_THINK)


@pytest.mark.parametrize("effort", ["low", "high", "max"])
def test_thinking_efforts(tok, effort):
    assert encode_messages(tok, [UserMessage("Hi")], thinking=effort) == xtml(tok, EFFORT.format(effort) + USER_HI + GEN_THINK)


def test_no_thinking_opens_the_response_channel(tok):
    assert encode_messages(tok, [UserMessage("Hi")], thinking=None) == xtml(tok, USER_HI + GEN_RESPONSE)
    assert encode_messages(tok, [UserMessage("Hi")], thinking=None, add_generation_prompt=False) == xtml(tok, USER_HI)


def test_system_with_name_and_attribute_escaping(tok):
    messages = [SystemMessage("Be terse.", name='a&b "q"'), UserMessage("Hi", name="bob")]
    expected = ('<|open|>message¦ role="system"¦ name="a&amp;b &quot;q&quot;"<|sep|>Be terse.<|close|>message<|sep|>'
                '<|end_of_msg|><|open|>message¦ role="user"¦ name="bob"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>')
    assert encode_messages(tok, messages, thinking=None, add_generation_prompt=False) == xtml(tok, expected)


def test_assistant_history_think_channel(tok):
    messages = [UserMessage("Hi"), AssistantMessage("Hello.", reasoning="Greet back."), UserMessage("Hi"),
                AssistantMessage("Again."), UserMessage("Hi"), AssistantMessage("Third.", reasoning="  \n")]
    turn = '<|open|>message¦ role="assistant"<|sep|><|open|>think<|sep|>{}<|close|>think<|sep|><|open|>response<|sep|>{}' \
           '<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
    expected = (EFFORT.format("max") + USER_HI + turn.format("Greet back.", "Hello.") + USER_HI + turn.format("", "Again.")
                + USER_HI + turn.format("", "Third.") + GEN_THINK)
    assert encode_messages(tok, messages) == xtml(tok, expected)
    # Without thinking the think channels are gone, reasoning or not.
    plain = '<|open|>message¦ role="assistant"<|sep|><|open|>response<|sep|>Hello.<|close|>response<|sep|>' \
            '<|close|>message<|sep|><|end_of_msg|>'
    assert encode_messages(tok, messages[:2], thinking=None) == xtml(tok, USER_HI + plain + GEN_RESPONSE)


WEATHER = Tool("weather", "Current weather.", {"type": "object", "properties": {"city": {"type": "string"}}})
CLOCK = Tool("clock")


def test_tools_calls_and_results(tok):
    call_args = {"city": "Paris", "days": 3, "metric": True, "x": None, "opts": {"b": 1, "a": [1, "é"]},
                 "hours": [6, 12.5]}
    messages = [
        UserMessage("Weather?"),
        AssistantMessage("", reasoning="Call both.", tool_calls=(
            ToolCall("weather", call_args, id="c1"), ToolCall("clock", RawArguments("{not json"), id="c2"))),
        # Results given out of order are put in call order; their index is their position.
        ToolMessage("12:00", tool_call_id="c2"), ToolMessage("18 C", tool_call_id="c1"),
    ]
    declared = json.dumps([WEATHER.to_json(), CLOCK.to_json()], ensure_ascii=False, separators=(",", ":"),
                          sort_keys=True)
    assert declared.startswith('[{"function":{"description":"Current weather.","name":"weather","parameters":')
    declare = ('<|open|>message¦ role="system"¦ type="tool-declare"<|sep|># Tools\nHere are the available tools, '
               f"described in JSONSchema.\n\n```json\n{declared}\n```<|close|>message<|sep|><|end_of_msg|>")
    args = "".join(f'<|open|>argument¦ key="{k}"¦ type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in [
        ("city", "string", "Paris"), ("days", "number", "3"), ("metric", "boolean", "true"), ("x", "null", "null"),
        ("opts", "object", '{"b": 1, "a": [1, "é"]}'), ("hours", "array", "[6, 12.5]")])
    assistant = ('<|open|>message¦ role="assistant"<|sep|><|open|>think<|sep|>Call both.<|close|>think<|sep|>'
                 '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
                 f'<|open|>call¦ tool="weather"¦ index="1"<|sep|>{args}<|close|>call<|sep|>'
                 '<|open|>call¦ tool="clock"¦ index="2"<|sep|><|open|>json¦ type="object"<|sep|>{not json'
                 '<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    results = ('<|open|>message¦ role="tool"¦ tool="weather"¦ index="1"<|sep|>18 C<|close|>message<|sep|><|end_of_msg|>'
               '<|open|>message¦ role="tool"¦ tool="clock"¦ index="2"<|sep|>12:00<|close|>message<|sep|><|end_of_msg|>')
    user = '<|open|>message¦ role="user"<|sep|>Weather?<|close|>message<|sep|><|end_of_msg|>'
    expected = declare + EFFORT.format("max") + user + assistant + results + GEN_THINK
    assert encode_messages(tok, messages, tools=[WEATHER, CLOCK]) == xtml(tok, expected)


def test_tool_result_without_id_takes_its_position_and_unmatched_runs_keep_their_order(tok):
    calls = (ToolCall("a", {}, id="1"), ToolCall("b", {}, id="2"))
    messages = [AssistantMessage("", tool_calls=calls), ToolMessage("rb", tool_call_id="2"), ToolMessage("r?"),
                ToolMessage("named", name="zz")]
    ids = encode_messages(tok, messages, thinking=None, add_generation_prompt=False)
    tail = ('<|open|>message¦ role="tool"¦ tool="b"¦ index="1"<|sep|>rb<|close|>message<|sep|><|end_of_msg|>'
            '<|open|>message¦ role="tool"¦ tool="b"¦ index="2"<|sep|>r?<|close|>message<|sep|><|end_of_msg|>'
            '<|open|>message¦ role="tool"¦ tool="zz"¦ index="3"<|sep|>named<|close|>message<|sep|><|end_of_msg|>')
    assert ids[-len(xtml(tok, tail)):] == xtml(tok, tail)
    with pytest.raises(ValueError, match=r"messages\[1\]: a tool result with no tool name"):
        encode_messages(tok, [UserMessage("x"), ToolMessage("orphan")])


def test_new_tools_tool_choice_and_response_formats(tok):
    messages = [UserMessage("Hi"), NewTools((CLOCK,))]
    declared = '[{"function":{"name":"clock"},"type":"function"}]'
    dynamic = ('<|open|>message¦ role="system"¦ type="tool-declare"<|sep|>## New Tools Available\nThe system '
               "dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools."
               f"\nHere are the specs for the extended tools.\n\n```json\n{declared}\n```<|close|>message<|sep|>"
               "<|end_of_msg|>")
    choice = ('<|open|>message¦ role="system"¦ type="tool-choice"<|sep|>The system is invoked with '
              "`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>")
    note = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
    fmt = ('<|open|>message¦ role="system"¦ type="response-format"<|sep|>The system is invoked with '
           f"`response_format=json_schema`.\n{note}\nThe JSON data must match the following schema:\n"
           '```json\n{"properties":{"a":{"type":"integer"}},"type":"object"}\n```<|close|>message<|sep|><|end_of_msg|>')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ids = encode_messages(tok, messages, thinking=None, tool_choice="required", response_format=ResponseFormat(schema))
    assert ids == xtml(tok, USER_HI + dynamic + choice + fmt + GEN_RESPONSE)
    none = ('<|open|>message¦ role="system"¦ type="tool-choice"<|sep|>The system is invoked with `tool_choice=none`.\n'
            "You MUST NOT call any tools in the next message.<|close|>message<|sep|><|end_of_msg|>")
    obj = ('<|open|>message¦ role="system"¦ type="response-format"<|sep|>The system is invoked with '
           f"`response_format=json_object`.\n{note}<|close|>message<|sep|><|end_of_msg|>")
    ids = encode_messages(tok, [UserMessage("Hi")], thinking=None, tool_choice="none", response_format=ResponseFormat())
    assert ids == xtml(tok, USER_HI + none + obj + GEN_RESPONSE)


def test_images_and_content_parts_are_separate_pieces(tok):
    messages = [UserMessage(["Hello", "world", ImagePart(640, 480), "Hello"])]
    expected = ('<|open|>message¦ role="user"<|sep|>Hello¦world<|media_begin|>image 640x480<|media_content|>'
                '<|media_pad|><|media_end|>Hello<|close|>message<|sep|><|end_of_msg|>')
    assert encode_messages(tok, messages, thinking=None, add_generation_prompt=False) == xtml(tok, expected)


def test_piece_boundaries_are_visible_in_the_test_bpe():
    tok = bpe_tokenizer()  # the expected ids above would not pass if pieces were merged
    assert tok.encode("Helloworld") != tok.encode("Hello") + tok.encode("world")
    assert len(tok.encode("message")) == 1


def test_openai_dicts_give_the_same_ids(tok):
    dicts = [
        {"role": "system", "content": "S", "tools": [{"type": "function", "function": {"name": "clock"}}]},
        {"role": "developer", "content": "skipped, as in the release"},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "width": 2, "height": 3}]},
        {"role": "assistant", "content": None, "reasoning_content": "r",
         "tool_calls": [{"id": "k", "type": "function", "function": {"name": "clock", "arguments": '{"tz": "UTC"}'}},
                        {"id": "j", "function": {"name": "clock", "arguments": "oops"}}]},
        {"role": "tool", "tool_call_id": "j", "content": "2"}, {"role": "tool", "tool_call_id": "k", "content": "1"},
    ]
    typed = [NewTools((CLOCK,)), UserMessage(["Hi", ImagePart(2, 3)]),
             AssistantMessage("", "r", (ToolCall("clock", {"tz": "UTC"}, "k"), ToolCall("clock", RawArguments("oops"), "j"))),
             ToolMessage("2", "j"), ToolMessage("1", "k")]
    assert messages_from_dicts(dicts) == typed
    tools = tools_from_dicts([{"type": "function", "function": {"name": "clock"}}])
    assert encode_messages(tok, messages_from_dicts(dicts), tools=tools) == encode_messages(tok, typed, tools=tools)
    with pytest.raises(ValueError, match="arguments must be a JSON object; got list"):
        ToolCall.from_json_text("f", "[1]")


def test_training_mask_covers_exactly_the_assistant_targets(tok):
    messages = [SystemMessage("S"), UserMessage("Hi"), AssistantMessage("A1", reasoning="R1"), UserMessage("Hi"),
                AssistantMessage("", tool_calls=(ToolCall("clock", {"tz": "UTC"}),)), ToolMessage("12:00"),
                AssistantMessage("A3")]
    ids, mask = encode_for_training(tok, messages, tools=[CLOCK])
    assert ids == encode_messages(tok, messages, tools=[CLOCK], add_generation_prompt=False)
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    # Cut the ids where the mask changes: the targets are what follows each generation prompt.
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append(ids[start:i])
            start = None
    tail = "<|close|>response<|sep|>{}<|close|>message<|sep|><|end_of_msg|>"
    call = ('<|open|>tools<|sep|><|open|>call¦ tool="clock"¦ index="1"<|sep|><|open|>argument¦ key="tz"¦ '
            'type="string"<|sep|>UTC<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    assert runs == [xtml(tok, "R1<|close|>think<|sep|><|open|>response<|sep|>A1" + tail.format("")),
                    xtml(tok, "<|close|>think<|sep|><|open|>response<|sep|>" + tail.format(call)),
                    xtml(tok, "<|close|>think<|sep|><|open|>response<|sep|>A3" + tail.format(""))]
    # Each run starts right after a generation prompt.
    prompt = xtml(tok, GEN_THINK)
    first = mask.index(1)
    assert ids[first - len(prompt):first] == prompt
    ids, mask = encode_for_training(tok, messages[:3], thinking=None)
    first = mask.index(1)
    assert ids[first - len(xtml(tok, GEN_RESPONSE)):first] == xtml(tok, GEN_RESPONSE)
    assert ids[first:] == xtml(tok, "A1" + tail.format("")) and all(mask[first:])


def test_decode_gives_the_rendering():
    tok = bpe_tokenizer()
    ids = encode_messages(tok, [SystemMessage("S"), UserMessage("Hi")], tools=[CLOCK])
    text = tok.decode(ids)
    assert text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\n')
    assert text.endswith('<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
                         '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
