"""K3Config.from_hf on the golden release layout, on configs/*.json, and on broken configs."""

import copy
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax import ConfigError, K3Config, K3Model
from tests.conftest import GOLDEN_DIR

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
BARE_TEXT_CONFIGS = ["k3_tiny", "k3_mini", "k3_narrow_93"]


def golden_dir() -> Path:
    return GOLDEN_DIR


@pytest.fixture
def golden() -> dict:
    """A fresh copy of the golden release-layout config.json, safe to mutate."""
    return json.loads((golden_dir() / "config.json").read_text())


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def k3_mixers(n: int) -> tuple[str, ...]:
    """K3 rule: MLA at 1-based multiples of 4 and at the last layer, KDA elsewhere."""
    return tuple("mla" if (i + 1) % 4 == 0 or i == n - 1 else "kda" for i in range(n))


# ---- valid configs ------------------------------------------------------------------------------

def test_golden_dir_and_dict_agree(golden):
    from_dir = K3Config.from_hf(golden_dir())
    assert from_dir == K3Config.from_hf(golden_dir() / "config.json") == K3Config.from_hf(golden)
    assert from_dir.num_hidden_layers == 13 and from_dir.hidden_size == 128 and from_dir.vocab_size == 512
    assert from_dir.mixer_kinds == k3_mixers(13)
    assert [i for i, k in enumerate(from_dir.mixer_kinds) if k == "mla"] == [3, 7, 11, 12]
    assert from_dir.ffn_kinds == ("dense",) + ("moe",) * 12
    assert from_dir.attn_res_block_size == 3 and from_dir.num_attn_res_blocks == 5
    assert (from_dir.bos_token_id, from_dir.eos_token_id, from_dir.pad_token_id) == (256, 258, 511)
    assert from_dir.dtype == "bfloat16"


def test_release_config():
    cfg = K3Config.from_hf(CONFIGS / "kimi_k3.json")
    assert cfg.num_hidden_layers == 93 and cfg.hidden_size == 7168 and cfg.vocab_size == 163840
    assert cfg.mixer_kinds.count("kda") == 69 and cfg.mixer_kinds.count("mla") == 24
    assert cfg.mixer_kinds == k3_mixers(93)
    assert [cfg.mixer_kinds[i] for i in (0, 3, 91, 92)] == ["kda", "mla", "mla", "mla"]
    assert cfg.ffn_kinds == ("dense",) + ("moe",) * 92
    assert cfg.num_attn_res_blocks == 8
    assert cfg.kda_proj_dim == 12288 and cfg.kda_conv_kernel == 4 and cfg.kda_gate_lower_bound == -5.0
    assert cfg.shared_intermediate_size == 6144
    assert (cfg.mla_num_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (96, 1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_head_dim) == (128, 64, 128, 192)
    assert (cfg.num_experts, cfg.num_experts_per_token) == (896, 16)
    assert (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size, cfg.intermediate_size) == (3072, 3584, 33792)
    assert (cfg.situ_beta, cfg.situ_linear_beta) == (4.0, 25.0)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (163584, 163586, 163839)
    assert cfg.dtype == "bfloat16"


def test_release_config_has_the_release_key_set(golden):
    """configs/kimi_k3.json keeps the golden (= release) key set and nesting, with the release values."""
    release = load("kimi_k3")

    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k not in ("id2label", "label2id"):
                out |= keys(v, f"{prefix}{k}.")
        return out

    assert keys(release) == keys(golden)
    assert release["model_type"] == "kimi_k3" and release["text_config"]["model_type"] == "kimi_linear"
    assert release["media_placeholder_token_id"] == 163605
    assert release["text_config"]["max_position_embeddings"] == 1048576
    assert release["text_config"]["linear_attn_config"]["full_attn_layers"] == list(range(4, 93, 4)) + [93]
    vision = release["vision_config"]
    assert (vision["vt_num_hidden_layers"], vision["vt_hidden_size"], vision["vt_num_attention_heads"]) == (27, 1024, 12)
    assert (vision["qkv_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]) == (1536, 4096, 14)
    assert (vision["init_pos_emb_height"], vision["init_pos_emb_width"], vision["init_pos_emb_time"]) == (64, 64, 4)
    assert (vision["mm_hidden_size"], vision["text_hidden_size"]) == (1024, 7168)


@pytest.mark.parametrize("name", BARE_TEXT_CONFIGS)
def test_bare_text_configs(name):
    raw = load(name)
    assert raw["model_type"] == "kimi_linear" and "text_config" not in raw
    cfg = K3Config.from_hf(CONFIGS / f"{name}.json")
    assert cfg.mixer_kinds == k3_mixers(cfg.num_hidden_layers)
    assert cfg.ffn_kinds[0] == "dense" and set(cfg.ffn_kinds[1:]) == {"moe"}


@pytest.mark.parametrize("path", sorted((REPO / "k3jax" / "configs").glob("*.json")) + [REPO / "k3jax" / "tiny_k3"],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_packaged_configs_load_and_match_the_repository_ones(path):
    """The configs shipped inside the package pass the same checks (and equal configs/ where both exist)."""
    cfg = K3Config.from_hf(path)
    if (CONFIGS / path.name).is_file():
        assert cfg == K3Config.from_hf(CONFIGS / path.name)


def test_tiny_is_the_golden_text_config_in_float32(golden):
    text_only = dataclasses.replace(K3Config.from_hf(golden), dtype="float32", vision=None, media_placeholder_token_id=None)
    assert K3Config.from_hf(CONFIGS / "k3_tiny.json") == text_only


def test_narrow_93_has_the_k3_layer_pattern():
    narrow, release = K3Config.from_hf(CONFIGS / "k3_narrow_93.json"), K3Config.from_hf(CONFIGS / "kimi_k3.json")
    assert narrow.layer_kinds == release.layer_kinds
    assert narrow.attn_res_block_size == 12 and narrow.num_attn_res_blocks == 8


@pytest.mark.parametrize("source", ["golden", "kimi_k3"])
def test_bare_text_config_equals_wrapper(golden, source):
    wrapper = golden if source == "golden" else load("kimi_k3")
    text_only = dataclasses.replace(K3Config.from_hf(wrapper), vision=None, media_placeholder_token_id=None)
    assert K3Config.from_hf(copy.deepcopy(wrapper["text_config"])) == text_only


# ---- broken configs -----------------------------------------------------------------------------

def _drop(key):
    return lambda t: t.pop(key)


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


def _set_linear(key, value):
    return lambda t: t["linear_attn_config"].__setitem__(key, value)


def _grouped(t):
    t.update(use_grouped_topk=True, num_expert_group=4, topk_group=2)


BROKEN = {
    "missing hidden_size": (_drop("hidden_size"), r"text_config\.hidden_size is missing"),
    "missing linear num_heads": (
        lambda t: t["linear_attn_config"].pop("num_heads"), r"text_config\.linear_attn_config\.num_heads is missing"),
    "0-based kda_layers": (
        lambda t: t["linear_attn_config"].__setitem__("kda_layers", [0, 1, 2, 4, 5, 6, 8, 9, 10]),
        r"linear_attn_config\.kda_layers has \[0\]"),
    "layer in both lists": (
        lambda t: t["linear_attn_config"]["kda_layers"].append(4), r"kda_layers/full_attn_layers.*in both: \[4\]"),
    "layer in neither list": (
        lambda t: t["linear_attn_config"]["kda_layers"].remove(5), r"kda_layers/full_attn_layers.*in neither: \[5\]"),
    "silu": (_set("hidden_act", "silu"), r"text_config\.hidden_act='silu' is not supported"),
    "softmax router": (_set("moe_router_activation_func", "softmax"), r"text_config\.moe_router_activation_func"),
    "mla_use_nope false": (_set("mla_use_nope", False), r"text_config\.mla_use_nope"),
    "use_full_rank_gate false": (_set_linear("use_full_rank_gate", False), r"linear_attn_config\.use_full_rank_gate"),
    "positive gate_lower_bound": (_set_linear("gate_lower_bound", 5.0), r"linear_attn_config\.gate_lower_bound"),
    "group-limited routing": (_grouped, r"text_config\.topk_group/num_expert_group"),
    "kv heads differ": (_set("num_key_value_heads", 1), r"text_config\.num_key_value_heads"),
    "tied embeddings": (_set("tie_word_embeddings", True), r"text_config\.tie_word_embeddings"),
    "string hidden_size": (_set("hidden_size", "128"), r"text_config\.hidden_size='128'"),
    "bool for an int": (_set("num_experts_per_token", True), r"text_config\.num_experts_per_token=True"),
    "float for an int": (_set("num_hidden_layers", 13.0), r"text_config\.num_hidden_layers=13\.0"),
    "bool for a float": (_set("routed_scaling_factor", True), r"text_config\.routed_scaling_factor=True"),
    "string for a bool": (_set("latent_moe_use_norm", "true"), r"text_config\.latent_moe_use_norm='true'"),
    "string linear beta": (_set("activation_situ_linear_beta", "25"), r"text_config\.activation_situ_linear_beta"),
    "layers not a list": (_set_linear("kda_layers", "1,2,3"), r"linear_attn_config\.kda_layers must be a list"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_config_names_the_key(golden, case):
    mutate, message = BROKEN[case]
    mutate(golden["text_config"])
    with pytest.raises(ConfigError, match=message):
        K3Config.from_hf(golden)


def test_bare_text_config_errors_name_the_key(golden):
    text = golden["text_config"]
    text.pop("hidden_size")
    with pytest.raises(ConfigError, match=r"config\.hidden_size is missing"):
        K3Config.from_hf(text)


def test_wrapper_without_text_config(golden):
    golden.pop("text_config")
    with pytest.raises(ConfigError, match="text_config"):
        K3Config.from_hf(golden)


def test_not_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{'hidden_size': 7168,}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_hf(path)


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        K3Config.from_hf(tmp_path)


# ---- the full-size model, abstractly ------------------------------------------------------------

def test_full_size_model_shapes_and_parameter_count():
    cfg = K3Config.from_hf(CONFIGS / "kimi_k3.json", dtype="bfloat16")
    model = nnx.eval_shape(lambda: K3Model.init(cfg))
    leaves = jax.tree.leaves(nnx.state(model))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing was allocated
    count = sum(int(np.prod(x.shape)) for x in leaves)
    assert count == pytest.approx(2.779e12, rel=0.01)
    # the routed experts are almost all of it: 92 MoE layers x 896 experts x 3 x 3072 x 3584
    assert model.layer(92).block_sparse_moe.experts.w1.shape == (896, 3072, 3584)
    assert model.layer(0).mlp.gate_proj.weight.shape == (33792, 7168)
    assert model.layer(1).self_attn.q_proj.weight.shape == (12288, 7168)
    assert model.layer(3).self_attn.q_b_proj.weight.shape == (96 * 192, 1536)



def test_integer_is_not_accepted_for_a_boolean_flag(golden):
    golden["text_config"]["mla_use_nope"] = 1
    with pytest.raises(ConfigError, match="mla_use_nope"):
        K3Config.from_hf(golden)


def test_tied_embeddings_at_the_top_level_are_rejected(golden):
    golden["tie_word_embeddings"] = True
    with pytest.raises(ConfigError, match="config.tie_word_embeddings"):
        K3Config.from_hf(golden)
