"""`k3jax chat`: a multi-turn chat in the terminal, reading one user message per line of stdin.

    k3jax chat --model DIR [--image PATH]... [--system TEXT] [--thinking low|high|max|off]
               [--max-new-tokens N] [--temperature T] [--seed S] [--dtype bfloat16|float32]

The reply streams as it is produced: the reasoning first (dimmed on a terminal, after "thinking:"),
then the answer after "answer:", then any tool calls. `/reset` starts the conversation over, `/exit`
or end of input (Ctrl-D) quits; Ctrl-C during a reply drops that turn. Images given with `--image`
go with the first message, and `/image PATH` attaches one to the next. Every option is checked, the
tokenizer read and the images decoded before the model loads.
Control characters in the model's text are shown escaped, so a reply cannot drive the terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import unicodedata
from pathlib import Path
from typing import TextIO

from k3jax.chat.encoding import THINKING_EFFORTS
from k3jax.chat.messages import RawArguments, ToolCall
from k3jax.chat.session import Chat
from k3jax.chat.tokens import k3_tokenizer
from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import ConfigError, K3Config
from k3jax.memory_plan.command import int_at_least
from k3jax.pretrained import add_layers_argument, from_pretrained
from k3jax.tokenizer import check_text, load_tokenizer
from k3jax.vision.processor import ProcessorConfig, load_image

HELP = "/image PATH attaches an image to the next message, /reset starts over, /exit or Ctrl-D quits"
_DIM, _PLAIN = "\x1b[2m", "\x1b[0m"


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (0 is greedy), got {text!r}")
    return value


def _seed(text: str) -> int:
    value = int_at_least(0)(text)
    if value > 2**32 - 1:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32 - 1], got {text}")
    return value


def _system(text: str) -> str:
    try:
        return check_text(text, "the system message")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_chat_command(commands: argparse._SubParsersAction) -> None:
    """The `chat` subcommand's options."""
    chat = commands.add_parser("chat", help="chat with a K3 model in the terminal (multi-turn, streamed)")
    chat.add_argument("--model", type=Path, required=True, metavar="DIR",
                      help="HF release or `k3jax convert` directory")
    chat.add_argument("--image", type=Path, action="append", default=[], metavar="PATH",
                      help="an image for the first message (repeatable); /image PATH adds one later")
    chat.add_argument("--system", type=_system, default=None, metavar="TEXT", help="a system message to start with")
    chat.add_argument("--thinking", choices=(*THINKING_EFFORTS, "off"), default="max",
                      help="thinking effort (default max, as the release); off: answer without thinking")
    chat.add_argument("--max-new-tokens", type=int_at_least(1), default=4096, metavar="N", help="per reply")
    chat.add_argument("--temperature", type=_temperature, default=1.0, metavar="T",
                      help=">= 0; 0 is greedy (default 1.0)")
    chat.add_argument("--seed", type=_seed, default=0, metavar="S", help="in [0, 2**32 - 1]")
    chat.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    add_layers_argument(chat)


def _visible(text: str) -> str:
    """`text` with control characters other than newline and tab escaped (\\x1b, \\x07, ...)."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


def _format_call(call: ToolCall) -> str:
    if isinstance(call.arguments, RawArguments):
        return f"{call.name}({call.arguments.text})"
    return f"{call.name}({json.dumps(dict(call.arguments), ensure_ascii=False)})"


class _Printer:
    """Streams a reply: a heading when the channel changes, the reasoning dimmed on a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.channel = out, None
        self.color = out.isatty() and "NO_COLOR" not in os.environ

    def __call__(self, channel: str, text: str) -> None:
        if channel != self.channel:
            self.end_channel()
            heading = {"reasoning": "thinking:", "content": "answer:", "tool": "tool arguments:"}[channel]
            self.out.write(f"{heading} ")
            if channel == "reasoning" and self.color:
                self.out.write(_DIM)
            self.channel = channel
        self.out.write(_visible(text))
        self.out.flush()

    def end_channel(self) -> None:
        if self.channel is not None:
            self.out.write((_PLAIN if self.channel == "reasoning" and self.color else "") + "\n")
        self.channel = None


def _read_line(stdin: TextIO) -> str | None:
    """One line of input (None at end of input); bytes that are not UTF-8 are kept for check_text to name."""
    raw = stdin.buffer.readline() if hasattr(stdin, "buffer") else stdin.readline().encode()
    return None if not raw else raw.decode("utf-8", errors="surrogateescape").rstrip("\r\n")


def _checked_path(text: str) -> Path:
    return Path(check_text(text, "the image path"))


def run_chat_command(args: argparse.Namespace) -> int:
    """Check the checkpoint's config and tokenizer, load the model, then chat until /exit or end of input."""
    try:
        config = K3Config.from_hf(args.model / "config.json")
        tokenizer = k3_tokenizer(load_tokenizer(args.model))
    except (CheckpointError, ConfigError, OSError, ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        if args.image and config.vision is None:
            raise ValueError(f"--image: {args.model / 'config.json'} has no vision_config (a text-only model)")
        images = [load_image(path) for path in args.image]
        processor = ProcessorConfig.from_dir(args.model)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if args.image else 1
    top = max(tokenizer.special_tokens.values())
    if top >= config.vocab_size:
        print(f"error: the tokenizer's special ids reach {top}, beyond the model's vocab_size {config.vocab_size}",
              file=sys.stderr)
        return 1
    try:
        model = from_pretrained(args.model, dtype=args.dtype, layers=args.layers)
        chat = Chat(model, tokenizer, system=args.system, thinking=None if args.thinking == "off" else args.thinking,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                    processor=processor)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"k3jax chat ({HELP})", file=sys.stderr)
    return _loop(chat, images, has_vision=config.vision is not None, out=sys.stdout)


def _loop(chat: Chat, images: list, *, has_vision: bool, out: TextIO) -> int:
    """Read and answer messages until /exit or end of input; `images` go with the next message."""
    while True:
        out.write("> ")
        out.flush()
        line = _read_line(sys.stdin)
        if line is None:
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            chat.reset()
            images = []
            print("[conversation cleared]", file=out)
            continue
        if text.startswith("/image "):
            try:
                if not has_vision:
                    raise ValueError("this model has no vision tower (its config has no vision_config)")
                images.append(load_image(_checked_path(text.removeprefix("/image ").strip())))
            except (OSError, ValueError) as err:
                print(f"error: {err}", file=out)
                continue
            print(f"[{len(images)} image(s) for the next message]", file=out)
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text} ({HELP})", file=out)
            continue
        try:
            check_text(line, "the message")
        except ValueError as err:
            print(f"error: {err}", file=out)
            continue
        printer = _Printer(out)
        try:
            reply = chat.send(line, images=images, on_text=printer)
        except KeyboardInterrupt:  # Ctrl-C during a reply drops the turn; at the prompt it quits
            printer.end_channel()
            print("[interrupted: the turn was dropped]", file=out)
            continue
        except ValueError as err:  # e.g. an image the processor refuses: the turn is not taken
            printer.end_channel()
            print(f"error: {err}", file=out)
            continue
        finally:
            images = []
        printer.end_channel()
        for call in reply.tool_calls:
            print(f"tool call: {_visible(_format_call(call))}", file=out)
        if not reply.finished:
            print(f"[cut off at --max-new-tokens {chat.max_new_tokens}]", file=out)
