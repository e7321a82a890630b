"""Bad token ids and generation settings are ValueErrors naming the argument, raised before any
compile; valid edge values still reach the compiled programs unchanged. One row per case.

The jitted programs are replaced by recorders (`compiled`), so a check that fires too late fails
the test and the tables compile nothing; one end-to-end run checks the edge values for real.
"""

import importlib
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.generate import decode_step, generate, left_pad, prefill

gen = importlib.import_module("k3jax.generate")  # the module: the package exports the function `generate`
model_module = importlib.import_module("k3jax.model")

VOCAB, PAD = 512, 511  # the golden config's vocabulary and pad_token_id
PROMPT = [[5, 6, 7], [PAD, 8, 9]]
LENGTHS = [3, 2]


@pytest.fixture
def compiled(monkeypatch):
    """Replace every jitted entry with a recorder of its arguments (no compile, no run)."""
    calls = SimpleNamespace(generate=[], prefill=[], decode=[], forward=[])

    def recorder(name, result):
        def record(*args, **kwargs):
            getattr(calls, name).append(SimpleNamespace(args=args, kwargs=kwargs))
            return result(*args)
        return record

    fake = (jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32))
    monkeypatch.setattr(gen, "_generate", recorder("generate", lambda *a: fake))
    monkeypatch.setattr(gen, "_streamed", recorder("generate", lambda *a: fake))
    monkeypatch.setattr(gen, "_prefill", recorder("prefill", lambda *a: (None, None)))
    monkeypatch.setattr(gen, "_decode_step", recorder("decode", lambda *a: (None, None)))
    monkeypatch.setattr(model_module, "_forward", recorder("forward", lambda *a: None))
    return calls


# ---- token ids: checked before any cast, wherever they enter ----------------------------------------

BAD_IDS = {  # case -> (ids [B, T], regex)
    "int64 2**32+5 would wrap to 5": (np.array([[1, 2**32 + 5]], np.int64),
                                      r"input_ids must lie in \[0, vocab_size=512\); got values in \[1, 4294967301\]"),
    "uint64 2**63": (np.array([[2**63]], np.uint64), r"got values in \[9223372036854775808, 9223372036854775808\]"),
    "python int 2**70": ([[1, 2**70]], r"input_ids must be an integer array \[batch, seq\]; got object"),
    "float 3.7": (np.array([[3.7]]), r"input_ids must be an integer array \[batch, seq\]; got float64"),
    "float 3.0": ([[3.0, 1.0]], r"got float64"),
    "bool": (np.array([[True]]), r"got bool"),
    "negative": ([[-1, 4]], r"got values in \[-1, 4\]"),
    "= vocab": (jnp.asarray([[0, VOCAB]], jnp.int32), r"got values in \[0, 512\]"),
    "1-d": ([1, 2, 3], r"\[batch, seq\]; got int64 \(3,\)"),
    "empty batch": (np.zeros((0, 3), np.int32), r"input_ids has an empty batch \(shape \(0, 3\)\)"),
    "no tokens": (np.zeros((2, 0), np.int32), r"input_ids has no tokens"),
}
ENTRIES = {
    "forward": lambda m, ids: k3jax.forward(m, ids),
    "call": lambda m, ids: m(ids),
    "prefill": lambda m, ids: prefill(m, ids),
    "generate": lambda m, ids: generate(m, ids, max_new_tokens=1),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_input_ids(golden_model_fp32, compiled, entry, case):
    ids, message = BAD_IDS[case]
    with pytest.raises(ValueError, match=message):
        ENTRIES[entry](golden_model_fp32, ids)
    assert not (compiled.generate or compiled.prefill or compiled.forward)


def test_wide_valid_ids_reach_the_program_as_int32(golden_model_fp32, compiled):
    ids = np.array([[0, VOCAB - 1]], np.int64)
    k3jax.forward(golden_model_fp32, ids)
    prefill(golden_model_fp32, ids.astype(np.uint64))
    for got in (compiled.forward[0].args[1], compiled.prefill[0].args[1]):
        assert got.dtype == jnp.int32 and got.tolist() == [[0, VOCAB - 1]]


# ---- decode_step --------------------------------------------------------------------------------

BAD_TOKENS = {  # case -> (tokens for a cache of batch 2, regex)
    "= vocab": ([VOCAB, 0], r"tokens must lie in \[0, vocab_size=512\); got values in \[0, 512\]"),
    "-1": ([-1, 0], r"tokens must lie in \[0, vocab_size=512\); got values in \[-1, 0\]"),
    "3.7": ([3.7, 1.0], r"tokens must be an integer array \[batch\]; got float64"),
    "int64 2**32+5": (np.array([2**32 + 5, 1]), r"got values in \[1, 4294967301\]"),
    "2-d": ([[1], [2]], r"tokens must be an integer array \[batch\]; got int64 \(2, 1\)"),
    "batch 3 for a cache of 2": ([1, 2, 3], r"tokens has batch 3 but the cache holds batch 2"),
    "batch 1 for a cache of 2": ([1], r"tokens has batch 1 but the cache holds batch 2"),
    "empty": (np.zeros(0, np.int32), r"tokens has an empty batch"),
}


@pytest.mark.parametrize("case", BAD_TOKENS)
def test_decode_step_checks_its_tokens(golden_model_fp32, compiled, case):
    tokens, message = BAD_TOKENS[case]
    cache = golden_model_fp32.empty_cache(2, 4)
    with pytest.raises(ValueError, match=message):
        decode_step(golden_model_fp32, cache, tokens)
    assert not compiled.decode


def test_decode_step_valid_edge_tokens(golden_model_fp32, compiled):
    cache = golden_model_fp32.empty_cache(2, 4)
    decode_step(golden_model_fp32, cache, np.array([0, VOCAB - 1], np.int64))
    tokens = compiled.decode[0].args[2]
    assert tokens.dtype == jnp.int32 and tokens.tolist() == [0, VOCAB - 1]


# ---- generate settings --------------------------------------------------------------------------

BAD_SETTINGS = {  # case -> (generate keyword arguments, regex)
    "max_new_tokens 2.5": (dict(max_new_tokens=2.5), r"max_new_tokens=2\.5: expected an integer >= 1"),
    "max_new_tokens 0": (dict(max_new_tokens=0), r"max_new_tokens=0: expected an integer >= 1"),
    "max_new_tokens -3": (dict(max_new_tokens=-3), r"max_new_tokens=-3: expected an integer >= 1"),
    "max_new_tokens True": (dict(max_new_tokens=True), r"max_new_tokens=True: expected an integer"),
    "seed 2**32": (dict(seed=2**32), r"seed=4294967296: expected an integer in \[0, 4294967295\]"),
    "seed 2**63": (dict(seed=2**63), r"seed=9223372036854775808: expected an integer in \[0, 4294967295\]"),
    "seed 2**70": (dict(seed=2**70), r"seed=1180591620717411303424: expected"),
    "seed -1": (dict(seed=-1), r"seed=-1: expected an integer in \[0, 4294967295\]"),
    "seed 1.5": (dict(seed=1.5), r"seed=1\.5: expected an integer"),
    "temperature -0.1": (dict(temperature=-0.1), r"temperature=-0\.1: expected a finite number >= 0"),
    "temperature nan": (dict(temperature=float("nan")), r"temperature=nan: expected a finite number >= 0"),
    "temperature inf": (dict(temperature=float("inf")), r"temperature=inf: expected a finite number >= 0"),
    "temperature True": (dict(temperature=True), r"temperature=True: expected a finite number"),
    "top_p 0": (dict(temperature=1.0, top_p=0.0), r"top_p=0\.0: expected 0 < top_p <= 1"),
    "top_p 1.5": (dict(temperature=1.0, top_p=1.5), r"top_p=1\.5: expected 0 < top_p <= 1"),
    "top_p nan": (dict(temperature=1.0, top_p=float("nan")), r"top_p=nan: expected 0 < top_p <= 1"),
    "top_k -1": (dict(temperature=1.0, top_k=-1), r"top_k=-1: expected a positive integer or None"),
    "top_k 0": (dict(temperature=1.0, top_k=0), r"top_k=0: expected a positive integer"),
    "top_k 2.5": (dict(temperature=1.0, top_k=2.5), r"top_k=2\.5: expected a positive integer"),
    "stop token = vocab": (dict(stop_tokens=[3, VOCAB]), r"stop_tokens\[1\]=512: expected an integer in \[0, 511\]"),
    "stop token -1": (dict(stop_tokens=[-1]), r"stop_tokens\[0\]=-1: expected an integer in \[0, 511\]"),
    "stop token 3.7": (dict(stop_tokens=[3.7]), r"stop_tokens\[0\]=3\.7: expected an integer"),
    "stop token 2**32+5": (dict(stop_tokens=np.array([2**32 + 5])), r"stop_tokens\[0\]=.*4294967301.*expected"),
    "stop tokens an int": (dict(stop_tokens=258), r"stop_tokens=258: expected a sequence of token ids"),
    "pad id = vocab": (dict(pad_token_id=VOCAB), r"pad_token_id=512: expected an integer in \[0, 511\]"),
    "pad id -1": (dict(pad_token_id=-1), r"pad_token_id=-1: expected an integer in \[0, 511\]"),
    "pad id 1.0": (dict(pad_token_id=1.0), r"pad_token_id=1\.0: expected an integer"),
    "capacity 2.5": (dict(capacity=2.5), r"capacity=2\.5: expected an integer >= 1"),
    "capacity too small": (dict(capacity=3), r"need a cache of 4 tokens .* but capacity=3"),
    "prompt_lengths float": (dict(prompt_lengths=[3.0, 2.0]), r"prompt_lengths must be integers \[batch=2\]"),
    "prompt_lengths 0": (dict(prompt_lengths=[3, 0]), r"prompt_lengths must lie in \[1, 3\]"),
    "right-padded ids": (dict(input_ids=[[5, 6, 7], [8, 9, PAD]]),
                         r"input_ids row 1 looks RIGHT-padded: its last 1 tokens are pad_token_id=511 where "
                         r"prompt_lengths\[1\]=2 puts real tokens"),
    "right-padded, own pad id": (dict(input_ids=[[5, 6, 7], [8, 0, 0]], prompt_lengths=[3, 1], pad_token_id=0),
                                 r"row 1 looks RIGHT-padded: its last 2 tokens are pad_token_id=0"),
    "right-padded under a mask": (dict(input_ids=[[5, 6, 7], [8, 9, PAD]], prompt_lengths=None,
                                       attention_mask=[[1, 1, 1], [0, 1, 1]]), r"row 1 looks RIGHT-padded"),
    "mask of 0.5": (dict(prompt_lengths=None, attention_mask=[[1, 1, 1], [0.5, 1, 1]]),
                    r"attention_mask must hold 0 \(pad\) and 1 \(real token\) only"),
    "mask of 2": (dict(prompt_lengths=None, attention_mask=[[1, 1, 1], [0, 2, 1]]), r"attention_mask must hold 0"),
}


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_bad_generate_settings(golden_model_fp32, compiled, case):
    kwargs, message = BAD_SETTINGS[case]
    kwargs = dict(dict(input_ids=PROMPT, prompt_lengths=LENGTHS, max_new_tokens=2), **kwargs)
    with pytest.raises(ValueError, match=message):
        generate(golden_model_fp32, kwargs.pop("input_ids"), **kwargs)
    with pytest.raises(ValueError, match=message):  # the streamed loop checks the same way
        generate(golden_model_fp32, PROMPT if "input_ids" not in BAD_SETTINGS[case][0] else
                 BAD_SETTINGS[case][0]["input_ids"], on_token=lambda t: None, **kwargs)
    assert not compiled.generate


BAD_LEFT_PAD = {  # case -> (sequences, pad_token_id, regex)
    "float id": ([[1, 2], [3.7]], 0, r"left_pad: sequence 1 must be a list of integer token ids; got float64"),
    "id 2**32+5": ([[2**32 + 5]], 0, r"left_pad: sequence 0 has ids in \[4294967301, 4294967301\]; expected ids >= 0"),
    "negative id": ([[1, -2]], 0, r"left_pad: sequence 0 has ids in \[-2, 1\]"),
    "nested": ([[[1, 2]]], 0, r"left_pad: sequence 0 must be a list of integer token ids; got int64 \(1, 2\)"),
    "pad id -1": ([[1]], -1, r"pad_token_id=-1: expected an integer in \[0, 2147483647\]"),
    "pad id 1.5": ([[1]], 1.5, r"pad_token_id=1\.5: expected an integer"),
    "no sequence": ([], 0, r"left_pad: expected at least one sequence"),
    "an empty sequence": ([[1], []], 0, r"none of them empty"),
}


@pytest.mark.parametrize("case", BAD_LEFT_PAD)
def test_left_pad_checks_before_the_int32_cast(case):
    sequences, pad, message = BAD_LEFT_PAD[case]
    with pytest.raises(ValueError, match=message):
        left_pad(sequences, pad)


def test_left_pad_valid_edge_ids():
    ids, lengths = left_pad([np.array([2**31 - 1], np.int64), [0, 1]], pad_token_id=np.int64(7))
    assert ids.dtype == jnp.int32 and ids.tolist() == [[7, 2**31 - 1], [0, 1]] and lengths.tolist() == [1, 2]


def test_prefill_checks_padding_and_capacity(golden_model_fp32, compiled):
    with pytest.raises(ValueError, match=r"row 1 looks RIGHT-padded"):
        prefill(golden_model_fp32, [[5, 6, 7], [8, 9, PAD]], prompt_lengths=[3, 2])
    with pytest.raises(ValueError, match=r"capacity=4\.0: expected an integer"):
        prefill(golden_model_fp32, PROMPT, capacity=4.0)
    assert not compiled.prefill


EDGE_SETTINGS = {  # valid edge values -> what the compiled program receives
    "numpy ints": dict(max_new_tokens=np.int64(2), seed=np.uint32(2**32 - 1), stop_tokens=np.array([0, VOCAB - 1]),
                       pad_token_id=np.int64(0)),
    "integer temperature, top_p 1, huge top_k": dict(temperature=1, top_p=1, top_k=10**6),
    "left pad rows of pad id only": dict(input_ids=[[PAD, PAD, 7], [PAD, PAD, PAD]], prompt_lengths=[1, 1]),
    "prompts ending in the pad id, left-padded with it": dict(input_ids=[[5, PAD, PAD], [PAD, 8, PAD]],
                                                              prompt_lengths=[3, 2]),
    "jax stop tokens": dict(stop_tokens=jnp.asarray([258, 3])),
}


@pytest.mark.parametrize("case", EDGE_SETTINGS)
def test_valid_edge_settings_reach_the_program(golden_model_fp32, compiled, case):
    kwargs = dict(dict(input_ids=PROMPT, prompt_lengths=LENGTHS, max_new_tokens=2), **EDGE_SETTINGS[case])
    generate(golden_model_fp32, kwargs.pop("input_ids"), **kwargs)
    (call,) = compiled.generate
    _, ids, start, _, stop, pad, images = call.args
    assert images is None and ids.dtype == jnp.int32 and start.tolist() == [3 - n for n in kwargs["prompt_lengths"]]
    expected_stop = [int(t) for t in kwargs.get("stop_tokens", [])]
    assert stop.tolist() == expected_stop + [-1] * (8 - len(expected_stop))
    assert int(pad) == int(kwargs.get("pad_token_id", PAD))
    assert call.kwargs["max_new_tokens"] == 2 and type(call.kwargs["max_new_tokens"]) is int


def test_edge_values_run_end_to_end(golden_model_fp32):
    """The largest seed, the last vocabulary id and one new token run for real (one small compile)."""
    ids = np.array([[VOCAB - 1, 0, 5]], np.int64)
    first = generate(golden_model_fp32, ids, max_new_tokens=1, seed=2**32 - 1, temperature=0)
    again = generate(golden_model_fp32, ids.astype(np.int32), max_new_tokens=1, seed=0, temperature=0.0)
    assert first.shape == (1, 1) and first.tolist() == again.tolist()
