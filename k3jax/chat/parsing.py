"""The model's reply, token by token, back into reasoning, content and typed tool calls.

After the generation prompt (`O message role="assistant" S O think S`, or `... O response S` without
thinking) the model closes what the prompt opened and goes on:

    reasoning C think S O response S content C response S
    [O tools S (O call tool="NAME" index="k" S (O argument key="K" type="T" S value C argument S)* C call S)+
     C tools S] C message S E

`ReplyParser` reads that grammar incrementally: `feed(ids)` returns the new text with the channel it
belongs to ("reasoning", "content", or "tool" for argument values), so a caller can stream it, and
`result()` gives the reply parsed so far at any point. Nothing raises on model output: a reply cut
off mid-think is its reasoning with no content, a call cut off is left out, and whatever breaks the
grammar (a stray tag, a value that is not of its declared type, a special token inside text) is
noted in `errors` and kept out of the fields. Text is decoded with an incremental UTF-8 decoder, so a
character split across tokens is never garbled.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from k3jax.chat.messages import JSON, AssistantMessage, RawArguments, ToolCall
from k3jax.chat.tokens import control_ids
from k3jax.tokenizer import Tokenizer

Channel = Literal["reasoning", "content", "tool"]
_TEXT_CHANNEL: dict[str, Channel] = {"think": "reasoning", "response": "content", "argument": "tool", "json": "tool"}
_CHILDREN = {"message": ("think", "response", "tools"), "tools": ("call",), "call": ("argument", "json")}
_ATTR = re.compile(r' ([^\s="]+)="([^"]*)"')
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "number": (int, float), "boolean": bool, "null": type(None), "object": dict, "array": list,
}


@dataclass(frozen=True)
class ParsedReply:
    """A (possibly partial) assistant reply. `finished`: its `<|end_of_msg|>` was read."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    finished: bool
    errors: tuple[str, ...] = ()

    def to_message(self) -> AssistantMessage:
        """The reply as a history message (reasoning kept: K3 is trained with preserved thinking)."""
        return AssistantMessage(self.content, self.reasoning, self.tool_calls)


def _typed(kind: str, text: str) -> tuple[JSON, str | None]:
    """An argument's value from its text and declared type -> (value, error or None)."""
    if kind == "string":
        return text, None
    if kind not in _JSON_TYPES:
        return text, f"argument type {kind!r} is not one of string, {', '.join(_JSON_TYPES)}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text, f"argument of type {kind} is not JSON: {text[:80]!r}"
    expected = _JSON_TYPES[kind]
    if not isinstance(value, expected) or (kind == "number" and isinstance(value, bool)):
        return text, f"argument of type {kind} holds a {type(value).__name__}: {text[:80]!r}"
    return value, None


@dataclass
class _Call:
    name: str
    arguments: dict = field(default_factory=dict)
    raw: str | None = None


class ReplyParser:
    """Incremental parser of one assistant reply; `thinking` says which channel the prompt opened."""

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool = True) -> None:
        self.tokenizer = tokenizer
        self.c = control_ids(tokenizer)
        self.stack: list[str] = ["message", "think" if thinking else "response"]
        self.fields = {"reasoning": [], "content": []}
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.finished = False
        self._responded = not thinking  # the response channel has been opened
        self._tag: list[int] | None = None  # ids of a tag being read (after O or C, until S)
        self._tag_opens = True
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._value: list[str] = []  # text of the argument / json block being read
        self._argument: tuple[str, str] | None = None  # (key, type)
        self._call: _Call | None = None

    # -- text ------------------------------------------------------------------------------------
    def _channel(self) -> Channel | None:
        return _TEXT_CHANNEL.get(self.stack[-1]) if self.stack else None

    def _emit(self, text: str, out: list[tuple[Channel, str]]) -> None:
        if not text:
            return
        channel = self._channel()
        if channel is None:
            if text.strip():
                self.errors.append(f"text outside any channel: {text[:80]!r}")
            return
        if channel == "tool":
            self._value.append(text)
        else:
            self.fields[channel].append(text)
        out.append((channel, text))

    def _flush(self, out: list[tuple[Channel, str]]) -> None:
        self._emit(self._decoder.decode(b"", final=True), out)

    # -- tags ------------------------------------------------------------------------------------
    def _open(self, text: str) -> None:
        name, _, rest = text.partition(" ")
        # The exact inverse of the encoder's escaping (& -> &amp;, then " -> &quot;).
        attrs = {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in _ATTR.findall(" " + rest)}
        parents = [k for k, tag in enumerate(self.stack) if name in _CHILDREN.get(tag, ())]
        if not parents:
            self.errors.append(f"unexpected tag <{text}> inside <{self.stack[-1] if self.stack else None}>")
            return
        while len(self.stack) > parents[-1] + 1:  # e.g. <response> opened with <think> still open: close it
            self.errors.append(f"<{self.stack.pop()}> left open by <{name}>")
        self.stack.append(name)
        self._responded |= name == "response"
        if name == "call":
            self._call = _Call(attrs.get("tool", ""))
            if "tool" not in attrs:
                self.errors.append(f"tool call without a tool name: <{text}>")
        elif name == "argument":
            self._argument, self._value = (attrs.get("key", ""), attrs.get("type", "string")), []
        elif name == "json":
            self._value = []

    def _close(self, name: str) -> None:
        if name not in self.stack:
            self.errors.append(f"closing tag </{name}> with no open <{name}>")
            return
        while self.stack[-1] != name:
            self.errors.append(f"<{self.stack.pop()}> left open by </{name}>")
        self.stack.pop()
        if name == "argument" and self._call is not None and self._argument is not None:
            key, kind = self._argument
            value, error = _typed(kind, "".join(self._value))
            if error:
                self.errors.append(f"tool call {self._call.name!r}, argument {key!r}: {error}")
            self._call.arguments[key] = value
        elif name == "json" and self._call is not None:
            self._call.raw = "".join(self._value)
        elif name == "call" and self._call is not None:
            call = self._call
            arguments = RawArguments(call.raw) if call.raw is not None else call.arguments
            self.calls.append(ToolCall(call.name, arguments))
            self._call = None

    def _end_tag(self) -> None:
        text = self._tag_decoder_text()
        self._tag = None
        (self._open if self._tag_opens else self._close)(text)

    def _tag_decoder_text(self) -> str:
        return self.tokenizer.decode_bytes(self._tag).decode("utf-8", errors="replace")

    # -- tokens ----------------------------------------------------------------------------------
    def feed(self, ids: Iterable[int]) -> list[tuple[Channel, str]]:
        """Read more reply tokens; returns the new text, in order, with its channel."""
        out: list[tuple[Channel, str]] = []
        c = self.c
        for i in ids:
            i = int(i)
            if self.finished:
                self.errors.append(f"token {i} after <|end_of_msg|>")
                continue
            if i == c.end_of_msg:
                self._flush(out)
                if self._tag is not None:
                    self.errors.append("reply ended inside a tag")
                    self._tag = None
                self.finished = True
            elif i in (c.open, c.close):
                self._flush(out)
                if self._tag is not None:
                    self.errors.append(f"tag {self._tag_decoder_text()!r} not ended by <|sep|>")
                self._tag, self._tag_opens = [], i == c.open
            elif i == c.sep:
                if self._tag is None:
                    self.errors.append("<|sep|> outside a tag")
                else:
                    self._end_tag()
            elif i >= c.first_special:
                self.errors.append(f"special token {i} where text belongs")
            elif self._tag is not None:
                self._tag.append(i)
            else:
                self._emit(self._decoder.decode(self.tokenizer.decode_bytes([i])), out)
        return out

    def flush(self) -> list[tuple[Channel, str]]:
        """At the end of the reply: the bytes of a character left incomplete, as U+FFFD (streamed like `feed`)."""
        out: list[tuple[Channel, str]] = []
        self._flush(out)
        return out

    def closing_ids(self) -> list[int]:
        """The ids that end a reply cut off here as a well-formed message (the open tags closed, an empty
        response channel if none was opened, `C message S E`), so that a conversation can go on."""
        if self.finished:
            return []
        c, ids = self.c, []
        if self._tag is not None:  # cut inside a tag: end it as written
            ids.append(c.sep)
        stack = list(self.stack)
        if self._tag is not None and self._tag_opens and self._tag:
            stack.append(self._tag_decoder_text().partition(" ")[0])
        for tag in reversed(stack[1:]):
            ids += [c.close, *self.tokenizer.encode(tag), c.sep]
        if stack[:1] == ["message"]:
            if not self._responded and "response" not in stack:
                ids += [c.open, *self.tokenizer.encode("response"), c.sep, c.close, *self.tokenizer.encode("response"),
                        c.sep]
            ids += [c.close, *self.tokenizer.encode("message"), c.sep]
        return ids + [c.end_of_msg]

    def result(self) -> ParsedReply:
        """The reply read so far; bytes of a character not yet complete are shown as U+FFFD and a call not
        yet closed is left out. Reading it changes nothing: `feed` may go on."""
        fields = {name: "".join(parts) for name, parts in self.fields.items()}
        pending = self._decoder.getstate()[0]
        channel = self._channel()
        if pending and channel in fields:
            fields[channel] += pending.decode("utf-8", errors="replace")
        errors = list(self.errors)
        if not self.finished and self._call is not None:
            errors.append(f"reply cut off inside tool call {self._call.name!r}")
        return ParsedReply(fields["reasoning"], fields["content"], tuple(self.calls), self.finished, tuple(errors))


def parse_reply(tokenizer: Tokenizer, ids: Iterable[int], *, thinking: bool = True) -> ParsedReply:
    """A whole (or truncated) reply's ids -> ParsedReply; `thinking` as the generation prompt was made."""
    parser = ReplyParser(tokenizer, thinking=thinking)
    parser.feed(ids)
    return parser.result()
