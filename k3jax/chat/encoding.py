"""K3's chat format ("XTML"): typed messages -> token ids, for prompting and for training.

K3 ships no Jinja template; the release renders chats in Python, and this module follows that
renderer's grammar. Tags are built from control tokens (`O` = `<|open|>`, `C` = `<|close|>`, `S` =
`<|sep|>`, `E` = `<|end_of_msg|>`) and plain text; no newlines are added:

    tag open : O tag[ key="value"]* S          (values escape & -> &amp;, then " -> &quot;)
    tag close: C tag S
    system / user: O message role="system|user"[ name="…"] S content C message S E
    assistant    : O message role="assistant" S [O think S reasoning C think S]  (the think channel
                   whenever thinking is on, empty without reasoning) O response S content C response S
                   [O tools S (O call tool="NAME" index="k" S
                                 (O argument key="K" type="string|number|boolean|null|object|array" S value
                                  C argument S)*  |  O json type="object" S raw C json S
                               C call S)+ C tools S] C message S E
    tool result  : O message role="tool" tool="NAME" index="k" S content C message S E
    generation prompt: O message role="assistant" S O think S   (O response S without thinking)

Internal system messages (`O message role="system" type="KIND" S body C message S E`) declare the tools
(first), give the thinking effort (when thinking), and after the messages state `tool_choice`
("required" / "none") and the response format. An image in a user's content becomes
`<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>` (original size), one
`<|media_pad|>` per image, which the model expands to the image's features.

Safety: every piece of text (tags, attributes, contents, reasoning, argument values, tool schemas) is
encoded on its own with special tokens DISALLOWED, so no text can become a control token; control
tokens are emitted by id. Encoding piece by piece is also what makes the ids match the release's:
BPE never merges across two pieces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from k3jax.chat.messages import (
    MESSAGE_TYPES, AssistantMessage, Content, ImagePart, Message, NewTools, RawArguments, SystemMessage, Tool,
    ToolCall, ToolMessage, UserMessage,
)
from k3jax.chat.tokens import ControlIds, control_ids
from k3jax.tokenizer import Tokenizer

Thinking = Literal["low", "high", "max"] | None
THINKING_EFFORTS = ("low", "high", "max")  # "medium" is named in the preamble text but not accepted
DEFAULT_THINKING: Thinking = "max"  # the release's apply_chat_template default
TOOL_CHOICES = ("auto", "required", "none")

_EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
                "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={}`.")
_RAW_JSON_NOTE = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."


@dataclass(frozen=True)
class ResponseFormat:
    """Ask for raw JSON: any JSON object (`schema=None`), or JSON matching `schema`."""

    schema: Mapping | None = None


def _compact_json(value: object) -> str:
    """Key-sorted compact JSON, non-ASCII kept (the release's form for tool and response schemas)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _json_type(value: object, where: str) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ValueError(f"{where}: expected a JSON value, got {type(value).__name__}")


class _Builder:
    """Token ids (and the loss mask) of a rendering, appended piece by piece."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.c: ControlIds = control_ids(tokenizer)
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.train = 0  # 1 while appending tokens the model must learn to produce

    def control(self, token: int) -> None:
        self.ids.append(token)
        self.mask.append(self.train)

    def text(self, text: str) -> None:
        if text:
            new = self.tokenizer.encode(text)  # special-token strings stay text
            self.ids.extend(new)
            self.mask.extend([self.train] * len(new))

    def open(self, tag: str, attrs: Sequence[tuple[str, object]] = ()) -> None:
        self.control(self.c.open)
        self.text(tag)
        for key, value in attrs:
            escaped = str(value).replace("&", "&amp;").replace('"', "&quot;")
            self.text(f' {key}="{escaped}"')
        self.control(self.c.sep)

    def close(self, tag: str) -> None:
        self.control(self.c.close)
        self.text(tag)
        self.control(self.c.sep)

    def content(self, content: Content, where: str) -> None:
        if isinstance(content, str):
            self.text(content)
            return
        for k, part in enumerate(content):
            if isinstance(part, str):
                self.text(part)
            elif isinstance(part, ImagePart):
                self.control(self.c.media_begin)
                self.text(f"image {part.width}x{part.height}")
                for token in (self.c.media_content, self.c.media_pad, self.c.media_end):
                    self.control(token)
            else:
                raise TypeError(f"{where}.content[{k}]: expected a string or ImagePart, got {type(part).__name__}")

    def system(self, kind: str, body: str) -> None:
        """An internal system message (tool declarations, thinking effort, tool choice, format)."""
        self.open("message", [("role", "system"), ("type", kind)])
        self.text(body.strip())
        self.close("message")
        self.control(self.c.end_of_msg)


def _declare_tools(out: _Builder, tools: Sequence[Tool], dynamic: bool) -> None:
    schema = _compact_json([tool.to_json() for tool in tools])
    if dynamic:
        body = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
                f"```json\n{schema}\n```")
    else:
        body = f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{schema}\n```"
    out.system("tool-declare", body)


def _tool_calls(out: _Builder, calls: Sequence[ToolCall], where: str) -> None:
    out.open("tools")
    for index, call in enumerate(calls, start=1):
        out.open("call", [("tool", call.name), ("index", index)])
        if isinstance(call.arguments, RawArguments):
            out.open("json", [("type", "object")])
            out.text(call.arguments.text)
            out.close("json")
        else:
            for key, value in call.arguments.items():
                kind = _json_type(value, f"{where}.tool_calls[{index - 1}].arguments[{key!r}]")
                out.open("argument", [("key", key), ("type", kind)])
                out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                out.close("argument")
        out.close("call")
    out.close("tools")


def _assistant(out: _Builder, message: AssistantMessage, thinking: bool, train: bool, where: str) -> None:
    """An assistant turn; in training, everything after the generation prompt is a target."""
    out.open("message", [("role", "assistant")])
    if thinking:
        out.open("think")
        out.train = int(train)
        if message.reasoning is not None and message.reasoning.strip():
            out.text(message.reasoning)
        out.close("think")
        out.open("response")
    else:
        out.open("response")
        out.train = int(train)
    out.text(message.content)
    out.close("response")
    if message.tool_calls:
        _tool_calls(out, message.tool_calls, where)
    out.close("message")
    out.control(out.c.end_of_msg)
    out.train = 0


def _in_call_order(messages: Sequence[Message]) -> list[Message]:
    """Tool results named after the call their `tool_call_id` matches in the preceding assistant message,
    and each run of results put in call order when every one of them matches a call."""
    out: list[Message] = []
    calls: dict[str, tuple[int, str]] = {}
    k = 0
    while k < len(messages):
        message = messages[k]
        if not isinstance(message, ToolMessage):
            if isinstance(message, AssistantMessage):
                calls = {}
                for position, call in enumerate(message.tool_calls, start=1):
                    if call.id is not None:
                        calls.setdefault(str(call.id), (position, call.name))
            out.append(message)
            k += 1
            continue
        run = []
        while k < len(messages) and isinstance(messages[k], ToolMessage):
            run.append(messages[k])
            k += 1
        targets = [calls.get(str(r.tool_call_id)) if r.tool_call_id is not None else None for r in run]
        run = [ToolMessage(r.content, r.tool_call_id, t[1]) if t else r for r, t in zip(run, targets)]
        if all(targets):  # otherwise the run keeps its order
            run = [run[j] for j in sorted(range(len(run)), key=lambda j: targets[j][0])]
        out.extend(run)
    return out


def _check_options(thinking: object, tool_choice: object, response_format: object) -> None:
    if thinking is not None and thinking not in THINKING_EFFORTS:
        raise ValueError(f"thinking={thinking!r}: expected one of {', '.join(THINKING_EFFORTS)}, or None for no "
                         "thinking")
    if tool_choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice={tool_choice!r}: expected one of {', '.join(TOOL_CHOICES)}")
    if response_format is not None and not isinstance(response_format, ResponseFormat):
        raise TypeError(f"response_format: expected a ResponseFormat or None, got {type(response_format).__name__}")


def _check_message(message: object, where: str) -> None:
    """The fields' types, before anything is encoded (the dataclasses take whatever they are given)."""
    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"{where}: expected one of {', '.join(t.__name__ for t in MESSAGE_TYPES)}, "
                        f"got {type(message).__name__} (see messages_from_dicts for OpenAI-style dicts)")
    if isinstance(message, NewTools):
        return
    content = message.content
    if isinstance(message, AssistantMessage):
        if not isinstance(content, str) or not isinstance(message.reasoning, (str, type(None))):
            raise TypeError(f"{where}: an assistant's content and reasoning must be strings")
        for j, call in enumerate(message.tool_calls):
            if not isinstance(call, ToolCall):
                raise TypeError(f"{where}.tool_calls[{j}]: expected a ToolCall, got {type(call).__name__}")
    elif not isinstance(content, (str, Sequence)):
        raise TypeError(f"{where}.content: expected a string or a list of strings and ImageParts, "
                        f"got {type(content).__name__}")


def _render(
    tokenizer: Tokenizer, messages: Sequence[Message], *, tools: Sequence[Tool] | None, thinking: Thinking,
    tool_choice: str, response_format: ResponseFormat | None, add_generation_prompt: bool, train: bool,
) -> _Builder:
    _check_options(thinking, tool_choice, response_format)
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages: expected a list of messages, got {type(messages).__name__}")
    for k, message in enumerate(messages):
        _check_message(message, f"messages[{k}]")
    tools = list(tools or ())
    for k, tool in enumerate(tools):
        if not isinstance(tool, Tool):
            raise TypeError(f"tools[{k}]: expected a Tool, got {type(tool).__name__} (see tools_from_dicts)")
    out = _Builder(tokenizer)
    if tools:
        _declare_tools(out, tools, dynamic=False)
    if thinking is not None:
        out.system("thinking-effort", _EFFORT_TEXT.format(thinking))
    calls: Sequence[ToolCall] = ()
    index = 0
    for k, message in enumerate(_in_call_order(messages)):
        where = f"messages[{k}]"
        if isinstance(message, NewTools):
            if message.tools:
                _declare_tools(out, message.tools, dynamic=True)
        elif isinstance(message, (SystemMessage, UserMessage)):
            role = "system" if isinstance(message, SystemMessage) else "user"
            out.open("message", [("role", role)] + ([("name", message.name)] if message.name else []))
            out.content(message.content, where)
            out.close("message")
            out.control(out.c.end_of_msg)
        elif isinstance(message, AssistantMessage):
            calls, index = message.tool_calls, 0
            _assistant(out, message, thinking is not None, train, where)
        else:  # ToolMessage
            index += 1
            name = message.name
            if name is None and index <= len(calls):
                name = calls[index - 1].name
            if name is None:
                raise ValueError(f"{where}: a tool result with no tool name, no tool_call_id of a call, and no "
                                 f"call at its position {index} in the preceding assistant message")
            out.open("message", [("role", "tool"), ("tool", name), ("index", index)])
            out.content(message.content, where)
            out.close("message")
            out.control(out.c.end_of_msg)
    if tool_choice != "auto":
        must = "call tools" if tool_choice == "required" else "NOT call any tools"
        out.system("tool-choice", f"The system is invoked with `tool_choice={tool_choice}`.\n"
                                  f"You MUST {must} in the next message.")
    if response_format is not None:
        if response_format.schema is None:
            out.system("response-format", f"The system is invoked with `response_format=json_object`.\n{_RAW_JSON_NOTE}")
        else:
            out.system("response-format", "The system is invoked with `response_format=json_schema`.\n"
                       f"{_RAW_JSON_NOTE}\nThe JSON data must match the following schema:\n"
                       f"```json\n{_compact_json(response_format.schema)}\n```")
    if add_generation_prompt:
        out.open("message", [("role", "assistant")])
        out.open("think" if thinking is not None else "response")
    return out


def encode_messages(
    tokenizer: Tokenizer, messages: Sequence[Message], *, tools: Sequence[Tool] | None = None,
    thinking: Thinking = DEFAULT_THINKING, tool_choice: str = "auto", response_format: ResponseFormat | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt ids of a conversation, ending (by default) in the generation prompt that opens the
    assistant's think channel (or its response channel when `thinking` is None).

    thinking: the thinking effort, "low" | "high" | "max" (the release default), or None for no thinking
        (no effort preamble, no think channels in assistant turns).
    tools: the tools the model may call, declared before everything else.
    tool_choice: "auto", or "required" / "none" (stated after the messages).
    Generation should stop at `<|end_of_msg|>` (`control_ids(tokenizer).end_of_msg`)."""
    return _render(tokenizer, messages, tools=tools, thinking=thinking, tool_choice=tool_choice,
                   response_format=response_format, add_generation_prompt=add_generation_prompt, train=False).ids


def encode_for_training(
    tokenizer: Tokenizer, messages: Sequence[Message], *, tools: Sequence[Tool] | None = None,
    thinking: Thinking = DEFAULT_THINKING, tool_choice: str = "auto", response_format: ResponseFormat | None = None,
) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a whole conversation (no generation prompt). loss_mask[i] is 1 where ids[i] is a
    token the model must produce: in every assistant turn, everything after what the generation prompt
    supplies (`O message role="assistant" S O think S`, or `... O response S` without thinking) — the
    reasoning, `C think S O response S`, the content, the tool calls, `C message S` and the closing
    `<|end_of_msg|>`. Everything else (system, user, tool turns, preambles) is 0."""
    out = _render(tokenizer, messages, tools=tools, thinking=thinking, tool_choice=tool_choice,
                  response_format=response_format, add_generation_prompt=False, train=True)
    return out.ids, out.mask
