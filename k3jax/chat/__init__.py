"""K3's chat format: typed messages, their encoding (prompts and training targets), parsing the
model's replies, a multi-turn `Chat` that keeps the model's cache between turns."""

from k3jax.chat.encoding import (
    DEFAULT_THINKING, THINKING_EFFORTS, ResponseFormat, encode_for_training, encode_messages,
)
from k3jax.chat.messages import (
    AssistantMessage, ImagePart, Message, NewTools, RawArguments, SystemMessage, Tool, ToolCall, ToolMessage,
    UserMessage, messages_from_dicts, tools_from_dicts,
)
from k3jax.chat.tokens import ControlIds, control_ids, k3_special_tokens, k3_tokenizer

__all__ = [
    "DEFAULT_THINKING", "THINKING_EFFORTS", "AssistantMessage", "ControlIds", "ImagePart", "Message", "NewTools",
    "RawArguments", "ResponseFormat", "SystemMessage", "Tool", "ToolCall", "ToolMessage", "UserMessage",
    "control_ids", "encode_for_training", "encode_messages", "k3_special_tokens", "k3_tokenizer",
    "messages_from_dicts", "tools_from_dicts",
]
