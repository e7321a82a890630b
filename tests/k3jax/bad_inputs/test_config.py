"""Config values that would make the model NaN or ill-defined are rejected when the config is read,
with an error naming the key, its value and what was expected. One row per case."""

import json
import math

import pytest

from k3jax import ConfigError, K3Config
from tests.conftest import GOLDEN_DIR


@pytest.fixture
def golden() -> dict:
    """A fresh copy of the golden release-layout config.json, safe to mutate."""
    return json.loads((GOLDEN_DIR / "config.json").read_text())


def _text(key, value):
    return lambda c: c["text_config"].__setitem__(key, value)


def _linear(key, value):
    return lambda c: c["text_config"]["linear_attn_config"].__setitem__(key, value)


def _top(key, value):
    return lambda c: c.__setitem__(key, value)


BAD = {  # case -> (mutation of the golden config, regex the ConfigError must match)
    "eps -1": (_text("rms_norm_eps", -1.0), r"text_config\.rms_norm_eps=-1\.0: expected a finite number > 0"),
    "eps 0": (_text("rms_norm_eps", 0.0), r"text_config\.rms_norm_eps=0\.0: expected a finite number > 0"),
    "eps nan": (_text("rms_norm_eps", math.nan), r"text_config\.rms_norm_eps=nan: expected a finite"),
    "eps inf": (_text("rms_norm_eps", math.inf), r"text_config\.rms_norm_eps=inf: expected a finite"),
    "scaling 10**400": (_text("routed_scaling_factor", 10**400),
                        r"text_config\.routed_scaling_factor=1000.*: expected a finite"),
    "scaling nan": (_text("routed_scaling_factor", math.nan), r"text_config\.routed_scaling_factor=nan"),
    "scaling 0": (_text("routed_scaling_factor", 0), r"text_config\.routed_scaling_factor=0: expected a finite"),
    "situ beta -4": (_text("activation_situ_beta", -4.0), r"text_config\.activation_situ_beta=-4\.0: expected"),
    "situ beta 0": (_text("activation_situ_beta", 0.0), r"text_config\.activation_situ_beta=0\.0"),
    "linear beta -1": (_text("activation_situ_linear_beta", -1.0),
                       r"text_config\.activation_situ_linear_beta=-1\.0: expected a finite number >= 0"),
    "linear beta nan": (_text("activation_situ_linear_beta", math.nan), r"activation_situ_linear_beta=nan"),
    "gate bound -inf": (_linear("gate_lower_bound", -math.inf),
                        r"linear_attn_config\.gate_lower_bound=-inf: expected a finite negative number"),
    "gate bound 0": (_linear("gate_lower_bound", 0.0), r"linear_attn_config\.gate_lower_bound=0\.0"),
    "hidden 0": (_text("hidden_size", 0), r"text_config\.hidden_size=0: expected an integer >= 1"),
    "vocab -5": (_text("vocab_size", -5), r"text_config\.vocab_size=-5: expected an integer >= 1"),
    "kda heads 0": (_linear("num_heads", 0), r"linear_attn_config\.num_heads=0: expected an integer >= 1"),
    "kda head_dim 0": (_linear("head_dim", 0), r"linear_attn_config\.head_dim=0"),
    "conv kernel 0": (_linear("short_conv_kernel_size", 0), r"linear_attn_config\.short_conv_kernel_size=0"),
    "mla heads 0": (_text("num_attention_heads", 0), r"text_config\.num_attention_heads=0"),
    "rope dim -1": (_text("qk_rope_head_dim", -1), r"text_config\.qk_rope_head_dim=-1: expected an integer >= 0"),
    "shared experts -1": (_text("num_shared_experts", -1), r"text_config\.num_shared_experts=-1"),
    "experts per token > experts": (_text("num_experts_per_token", 17),
                                    r"num_experts_per_token=17 must be in \[1, num_experts=16\]"),
    "experts per token 0": (_text("num_experts_per_token", 0), r"text_config\.num_experts_per_token=0"),
    "groups do not divide experts": (lambda c: c["text_config"].update(num_expert_group=3, topk_group=3),
                                     r"text_config\.num_expert_group=3: expected a divisor of num_experts=16"),
    "block size 0": (_text("attn_res_block_size", 0), r"text_config\.attn_res_block_size=0: expected an integer >= 1"),
    "block size > depth": (_text("attn_res_block_size", 14),
                           r"text_config\.attn_res_block_size=14: expected at most num_hidden_layers=13"),
    "dense prefix > depth": (_text("first_k_dense_replace", 14),
                             r"text_config\.first_k_dense_replace=14: expected at most num_hidden_layers=13"),
    "mxfp4 latent width": (_text("routed_expert_hidden_size", 48),
                           r"text_config\.routed_expert_hidden_size=48: .*MXFP4.* multiple of 32"),
    "mxfp4 expert width": (_text("moe_intermediate_size", 40), r"text_config\.moe_intermediate_size=40: .*MXFP4"),
    "pad id = vocab": (_top("pad_token_id", 512), r"pad_token_id=512: expected null or one integer token id in "
                                                  r"\[0, vocab_size=512\)"),
    "bos id -1": (_top("bos_token_id", -1), r"bos_token_id=-1: expected"),
    "eos id list": (_top("eos_token_id", [258, 259]), r"eos_token_id=\[258, 259\]: expected null or one integer"),
    "eos id float": (_top("eos_token_id", 258.0), r"eos_token_id=258\.0: expected"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_value_names_key_value_and_expectation(golden, case):
    mutate, message = BAD[case]
    mutate(golden)
    with pytest.raises(ConfigError, match=message):
        K3Config.from_hf(golden)


EDGE = {  # valid edge values still load
    "tiny eps": (_text("rms_norm_eps", 1e-30), lambda c: c.rms_norm_eps == 1e-30),
    "integer scaling": (_text("routed_scaling_factor", 2), lambda c: c.routed_scaling_factor == 2.0),
    "no linear cap (0)": (_text("activation_situ_linear_beta", 0), lambda c: c.situ_linear_beta is None),
    "no linear cap (null)": (_text("activation_situ_linear_beta", None), lambda c: c.situ_linear_beta is None),
    "block size = depth": (_text("attn_res_block_size", 13), lambda c: c.num_attn_res_blocks == 1),
    "block size 1": (_text("attn_res_block_size", 1), lambda c: c.num_attn_res_blocks == 13),
    "no dense layer": (_text("first_k_dense_replace", 0), lambda c: set(c.ffn_kinds) == {"moe"}),
    "all experts per token": (_text("num_experts_per_token", 16), lambda c: c.num_experts_per_token == 16),
    "no rope dims": (_text("qk_rope_head_dim", 0), lambda c: c.qk_rope_head_dim == 0),
    "pad id 0 and vocab-1": (lambda c: c.update(pad_token_id=0, bos_token_id=511),
                             lambda c: (c.pad_token_id, c.bos_token_id) == (0, 511)),
    "null token ids": (lambda c: c.update(pad_token_id=None, bos_token_id=None, eos_token_id=None),
                       lambda c: c.pad_token_id is None),
    "groups dividing experts": (lambda c: c["text_config"].update(num_expert_group=4, topk_group=4),
                                lambda c: c.num_experts == 16),
    "unquantized odd widths": (lambda c: c["text_config"].update(quantization_config=None, moe_intermediate_size=40),
                               lambda c: c.moe_intermediate_size == 40),
}


@pytest.mark.parametrize("case", EDGE)
def test_valid_edge_values_load(golden, case):
    mutate, check = EDGE[case]
    mutate(golden)
    assert check(K3Config.from_hf(golden))
