"""The typed message model of a K3 chat: what `encode_messages` renders and `parse_reply` returns.

    messages = [
        SystemMessage("You are terse."),
        UserMessage("Weather in Paris?"),
        AssistantMessage("", reasoning="Use the tool.", tool_calls=(ToolCall("weather", {"city": "Paris"}, id="c1"),)),
        ToolMessage("18 C, sunny", tool_call_id="c1"),
    ]

Tool-call arguments are typed JSON values (the format tags each with its JSON type); arguments that
were not a JSON object at all are kept as their raw text (`RawArguments`), which the format carries
in a `json` block. `messages_from_dicts` reads OpenAI-style dicts into these classes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

JSON = Union[None, bool, int, float, str, list, dict]


@dataclass(frozen=True)
class ImagePart:
    """An image inside a message's content, by its ORIGINAL size in pixels (the prompt names it)."""

    width: int
    height: int

    def __post_init__(self) -> None:
        for name in ("width", "height"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImagePart.{name}={value!r}: expected a positive integer (pixels)")


Content = Union[str, Sequence[Union[str, ImagePart]]]


@dataclass(frozen=True)
class RawArguments:
    """Tool-call arguments that did not parse as a JSON object: their text, rendered verbatim."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object as a dict, or `RawArguments`)."""

    name: str
    arguments: Mapping[str, JSON] | RawArguments = field(default_factory=dict)
    id: str | None = None

    @classmethod
    def from_json_text(cls, name: str, text: str | None, id: str | None = None) -> "ToolCall":
        """A call whose arguments arrive as a JSON string (OpenAI's form): empty -> {}, an object -> its
        dict, unparseable -> RawArguments; valid JSON that is not an object is an error."""
        if text is None or not text.strip():
            return cls(name, {}, id)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return cls(name, RawArguments(text), id)
        if not isinstance(value, dict):
            raise ValueError(f"tool call {name!r}: arguments must be a JSON object; got {type(value).__name__}")
        return cls(name, value, id)


@dataclass(frozen=True)
class Tool:
    """A tool declaration: rendered as OpenAI's {"type": "function", "function": {...}} JSON schema."""

    name: str
    description: str | None = None
    parameters: Mapping[str, JSON] | None = None

    def to_json(self) -> dict:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class SystemMessage:
    content: Content
    name: str | None = None


@dataclass(frozen=True)
class UserMessage:
    content: Content
    name: str | None = None


@dataclass(frozen=True)
class AssistantMessage:
    """A model turn: its reasoning (think channel), its answer (response channel) and its tool calls.
    Give the reasoning back in the history: K3 is trained with preserved thinking."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolMessage:
    """A tool's result. `tool_call_id` matches it to its call (results are put in call order); without
    one it answers the call at its position, and `name` may name the tool."""

    content: Content
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class NewTools:
    """Tools declared in the middle of a conversation (a system message carrying tools)."""

    tools: tuple[Tool, ...]


Message = Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage, NewTools]
MESSAGE_TYPES = (SystemMessage, UserMessage, AssistantMessage, ToolMessage, NewTools)


def _content_from_dict(content: Any, where: str) -> Content:
    """OpenAI content: a string, None, or a list of {"type": "text", "text"} / image parts (an image part
    needs "width" and "height": the chat prompt names the original size)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str | ImagePart] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            parts.append(part["text"])
        elif kind in ("image", "image_url"):
            if "width" not in part or "height" not in part:
                raise ValueError(f"{where}.content[{k}]: an image part needs its original 'width' and 'height'")
            parts.append(ImagePart(part["width"], part["height"]))
        else:
            raise ValueError(f"{where}.content[{k}]: expected a text or image part, got {part!r}")
    return parts


def _tool_from_dict(tool: Mapping, where: str) -> Tool:
    function = tool.get("function", tool)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: expected {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
    return Tool(function["name"], function.get("description"), function.get("parameters"))


def tools_from_dicts(tools: Sequence[Mapping]) -> tuple[Tool, ...]:
    """OpenAI tool declarations -> `Tool`s."""
    return tuple(_tool_from_dict(tool, f"tools[{k}]") for k, tool in enumerate(tools))


def messages_from_dicts(messages: Sequence[Mapping]) -> list[Message]:
    """OpenAI-style message dicts -> typed messages. As in the release renderer, roles it does not know
    (e.g. "developer") are skipped, and a system message carrying "tools" declares them."""
    out: list[Message] = []
    for k, message in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: expected a dict with a string 'role', got {message!r}")
        role, name = message["role"], message.get("name") or None
        if role == "system" and message.get("tools"):
            out.append(NewTools(tools_from_dicts(message["tools"])))
        elif role == "system":
            out.append(SystemMessage(_content_from_dict(message.get("content"), where), name))
        elif role == "user":
            out.append(UserMessage(_content_from_dict(message.get("content"), where), name))
        elif role == "assistant":
            calls = []
            for call in message.get("tool_calls") or ():
                function = call.get("function", call)
                arguments = function.get("arguments")
                if isinstance(arguments, Mapping):
                    calls.append(ToolCall(function["name"], dict(arguments), call.get("id")))
                else:
                    calls.append(ToolCall.from_json_text(function["name"], arguments, call.get("id")))
            content = message.get("content")
            if content is not None and not isinstance(content, str):
                content = "".join(p for p in _content_from_dict(content, where) if isinstance(p, str))
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            out.append(AssistantMessage(content or "", reasoning, tuple(calls)))
        elif role == "tool":
            out.append(ToolMessage(_content_from_dict(message.get("content"), where),
                                   message.get("tool_call_id", message.get("id")), name or message.get("tool")))
    return out
