"""K3's chat format: typed messages, their encoding (prompts and training targets), parsing the
model's replies, a multi-turn `Chat` that keeps the model's cache between turns."""

from k3jax.chat.encoding import (
    DEFAULT_THINKING, THINKING_EFFORTS, ResponseFormat, encode_for_training, encode_messages, encode_turn,
)
from k3jax.chat.messages import (
    AssistantMessage, ImagePart, Message, NewTools, RawArguments, SystemMessage, Tool, ToolCall, ToolMessage,
    UserMessage, messages_from_dicts, tools_from_dicts,
)
from k3jax.chat.parsing import ParsedReply, ReplyParser, parse_reply
from k3jax.chat.session import Chat, Reply
from k3jax.chat.tokens import ControlIds, control_ids, k3_special_tokens, k3_tokenizer

__all__ = [
    "DEFAULT_THINKING", "THINKING_EFFORTS", "AssistantMessage", "Chat", "ControlIds", "ImagePart", "Message",
    "NewTools", "ParsedReply", "RawArguments", "Reply", "ReplyParser", "ResponseFormat", "SystemMessage", "Tool",
    "ToolCall", "ToolMessage", "UserMessage", "control_ids", "encode_for_training", "encode_messages", "encode_turn",
    "k3_special_tokens", "k3_tokenizer", "messages_from_dicts", "parse_reply", "tools_from_dicts",
]
