"""Bad fine-tuning data: every record that is not one of the three kinds is an error naming file:line and field."""

from __future__ import annotations

import json

import pytest

from k3jax.tokenizer import ByteTokenizer
from k3jax.training.data import DataError, read_documents

TOKENIZER = ByteTokenizer(bos_id=256, eos_id=258, vocab_size=512)
GOOD = '{"text": "fine"}\n'

CASES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"text": "a", "input_ids": [1, 2]}', "exactly one of the fields messages, text, input_ids"),
    ("{}", "exactly one of the fields"),
    ('{"text": "a", "id": 3}', "unexpected field 'id'"),
    ('{"text": ""}', "text: expected a non-empty string"),
    ('{"text": 5}', "text: expected a non-empty string"),
    ('{"input_ids": [1, "2"]}', "input_ids: expected a list of integer token ids"),
    ('{"input_ids": [1, true]}', "input_ids: expected a list of integer token ids"),
    ('{"input_ids": [1, 512]}', "input_ids: token id 512 is outside the vocabulary [0, 512)"),
    ('{"input_ids": [1, -1]}', "token id -1 is outside"),
    ('{"input_ids": [1]}', "input_ids: 1 token(s); a document needs at least 2"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', "loss_mask: has 1 values, input_ids has 2"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', "loss_mask: expected a list of 0/1"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 0]}', "no token after the first carries loss"),
    ('{"messages": []}', "messages: expected a non-empty list"),
]


@pytest.mark.parametrize("line, message", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_record_names_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")  # a blank line still counts: the bad record is line 3
    with pytest.raises(DataError) as err:
        read_documents(path, TOKENIZER, vocab_size=512, encode_chat=lambda tok, m: ([1, 2], [0, 1]))
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def test_chat_encoder_errors_are_named(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [{"role": "wizard", "content": "x"}]}\n')

    def encode(tokenizer, messages):
        raise ValueError("role 'wizard': expected system, user, assistant or tool")

    with pytest.raises(DataError, match=rf"^{path}:1: messages: role 'wizard'"):
        read_documents(path, TOKENIZER, vocab_size=512, encode_chat=encode)


@pytest.mark.parametrize("content, message", [(b"", "no records"), (b"\xff\xfe", "not UTF-8 text")])
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_documents(path, TOKENIZER, vocab_size=512)


@pytest.mark.parametrize("messages, message", [
    ([{"content": "x"}], "messages: messages[0]: expected a dict with a string 'role'"),
    ([{"role": "user", "content": "only a question"}], "messages: no token after the first carries loss"),
])
def test_bad_chat_records_with_k3s_encoding(tmp_path, messages, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(DataError) as err:
        read_documents(path, TOKENIZER, vocab_size=512)
    assert str(err.value).startswith(f"{path}:1: ") and message in str(err.value)
