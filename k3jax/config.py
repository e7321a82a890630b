"""K3Config: the static description of a Kimi K3 text model, read from the release `config.json`.

The release nests the text model under `text_config` of a `kimi_k3` wrapper; a bare text config
(`model_type: kimi_linear`) is accepted too. Layer lists in `linear_attn_config` are 1-based.
Every field the model uses is read explicitly; a missing key or a value this implementation does
not support is an error that names the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

MixerKind = Literal["kda", "mla"]
FfnKind = Literal["dense", "moe"]

# Norm epsilons that the official code hard-codes rather than reading from the config.
MLA_LOW_RANK_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use KimiRMSNorm's default eps.
L2_NORM_EPS = 1e-6  # KDA q/k L2 norm: x * rsqrt(sum(x^2) + eps).

_SUPPORTED_DTYPES = ("bfloat16", "float32", "float16")
_MXFP4_BLOCK = 32  # elements per E8M0 scale of an MXFP4-packed weight (the release's routed experts)
_FLOAT_RULES = {  # rule name -> (test of a finite value, what the error says is expected)
    "positive": (lambda v: v > 0, "a finite number > 0"),
    "non-negative": (lambda v: v >= 0, "a finite number >= 0"),
    "negative": (lambda v: v < 0, "a finite negative number"),
}


class ConfigError(ValueError):
    """A config key is missing or has a value this implementation does not support."""


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """MoonViT-V2 tower and patch-merger projector (`vision_config`). The official code hard-codes
    tanh-GELU in the tower, erf-GELU in the projector and machine-epsilon tower norms, whatever the
    config's activation keys say, so those keys are not read."""

    patch_size: int
    hidden_size: int  # vt_hidden_size (= mm_hidden_size)
    num_layers: int
    num_heads: int
    qkv_hidden_size: int  # attention width, heads x head_dim
    intermediate_size: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int  # most frames one item may have
    text_hidden_size: int
    projector_eps: float

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class K3Config:
    """Hyper-parameters of the K3 text tower. Frozen and hashable, so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    mixer_kinds: tuple[MixerKind, ...]
    # KDA (linear_attn_config)
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_kernel: int
    kda_gate_lower_bound: float
    # Gated NoPE MLA
    mla_num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # FFNs
    first_k_dense_replace: int
    intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool
    num_shared_experts: int
    moe_renormalize: bool
    routed_scaling_factor: float
    situ_beta: float
    situ_linear_beta: float | None
    # Depth mixing and norms
    attn_res_block_size: int
    rms_norm_eps: float
    # Token ids and storage dtype
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    # The vision tower (None: a text-only model) and the one placeholder token each image takes.
    vision: VisionConfig | None = None
    media_placeholder_token_id: int | None = None

    def __post_init__(self) -> None:
        if len(self.mixer_kinds) != self.num_hidden_layers:
            raise ConfigError(
                f"mixer_kinds has {len(self.mixer_kinds)} entries, expected num_hidden_layers="
                f"{self.num_hidden_layers}"
            )
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; expected one of {_SUPPORTED_DTYPES}")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_token={self.num_experts_per_token} must be in [1, num_experts={self.num_experts}]"
            )
        if self.attn_res_block_size < 1:
            raise ConfigError(f"attn_res_block_size={self.attn_res_block_size}: expected an integer >= 1")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size
            ):
                raise ConfigError(
                    f"{name}={value!r}: expected null or one integer token id in [0, vocab_size={self.vocab_size})"
                )

    # ---- derived quantities -------------------------------------------------------------
    @property
    def ffn_kinds(self) -> tuple[FfnKind, ...]:
        return tuple("dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_hidden_layers))

    @property
    def layer_kinds(self) -> tuple[tuple[MixerKind, FfnKind], ...]:
        return tuple(zip(self.mixer_kinds, self.ffn_kinds))

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def num_attn_res_blocks(self) -> int:
        """Blocks pushed over the whole depth (at layers 0, S, 2S, ...): the size of the AttnRes bank."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any], **overrides: Any) -> "K3Config":
        """Read a release `config.json` (a path to it, its directory, or the parsed dict)."""
        raw = _load_json(path_or_dict)
        text = raw.get("text_config", raw) if raw.get("model_type") == "kimi_k3" else raw
        if raw.get("model_type") == "kimi_k3" and "text_config" not in raw:
            raise ConfigError("config of model_type 'kimi_k3' has no 'text_config'")
        cfg = _parse_text_config(text, top=raw)
        if "vision_config" in raw:
            vision = _parse_vision_config(_Reader(raw, "config").sub("vision_config"), cfg.hidden_size)
            placeholder = _Reader(raw, "config").int("media_placeholder_token_id", minimum=0)
            cfg = dataclasses.replace(cfg, vision=vision, media_placeholder_token_id=placeholder)
        return dataclasses.replace(cfg, **overrides)


def _load_json(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from err


class _Reader:
    """Typed access to one config dict with errors that name the full key."""

    def __init__(self, data: dict[str, Any], prefix: str = "text_config") -> None:
        self.data, self.prefix = data, prefix

    def _raw(self, key: str, default: Any) -> Any:
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is not _REQUIRED:
            return default
        raise ConfigError(f"config key {self.prefix}.{key} is missing")

    def int(self, key: str, default: Any = None, *, minimum: int = 1) -> int:
        value = self._raw(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"config key {self.prefix}.{key}={value!r}: expected an integer >= {minimum}")
        return value

    def float(self, key: str, default: Any = None, *, rule: str = "positive") -> float:
        """A finite number obeying `rule` (a key of _FLOAT_RULES): NaN, inf or a wrong sign would
        make every logit NaN or meaningless, so they are rejected here."""
        value = self._raw(key, _REQUIRED if default is None else default)
        test, expected = _FLOAT_RULES[rule]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        # An integer beyond the float range (JSON allows 1 followed by 400 digits) counts as not finite.
        number = float(value) if is_number and abs(value) <= 1e308 else math.inf
        if not (is_number and math.isfinite(number) and test(number)):
            raise ConfigError(f"config key {self.prefix}.{key}={value!r}: expected {expected}")
        return number

    def bool(self, key: str, default: Any = None) -> bool:
        value = self._raw(key, _REQUIRED if default is None else default)
        if not isinstance(value, bool):
            raise ConfigError(f"config key {self.prefix}.{key}={value!r}: expected true or false")
        return value

    def require(self, key: str, allowed: tuple[Any, ...], default: Any = None) -> Any:
        value = self._raw(key, _REQUIRED if default is None else default)
        # Compare type too, so that 1 does not pass for true (1 == True in Python).
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(
                f"config key {self.prefix}.{key}={value!r} is not supported; expected one of {list(allowed)}"
            )
        return value

    def sub(self, key: str) -> "_Reader":
        value = self._raw(key, _REQUIRED)
        if not isinstance(value, dict):
            raise ConfigError(f"config key {self.prefix}.{key} must be an object")
        return _Reader(value, f"{self.prefix}.{key}")


_REQUIRED = object()


def _mixer_kinds(linear: _Reader, num_layers: int) -> tuple[MixerKind, ...]:
    """Turn the 1-based kda_layers / full_attn_layers lists into one kind per 0-based layer."""
    lists = {}
    for key in ("kda_layers", "full_attn_layers"):
        value = linear._raw(key, _REQUIRED)
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise ConfigError(f"config key {linear.prefix}.{key} must be a list of 1-based layer numbers")
        bad = [i for i in value if not 1 <= i <= num_layers]
        if bad:
            raise ConfigError(
                f"config key {linear.prefix}.{key} has {bad}: layer numbers are 1-based, expected 1..{num_layers}"
            )
        lists[key] = set(value)
    both = lists["kda_layers"] & lists["full_attn_layers"]
    neither = set(range(1, num_layers + 1)) - lists["kda_layers"] - lists["full_attn_layers"]
    if both or neither:
        raise ConfigError(
            f"config keys {linear.prefix}.kda_layers/full_attn_layers must list every layer exactly once; "
            f"in both: {sorted(both)}, in neither: {sorted(neither)}"
        )
    return tuple("kda" if i + 1 in lists["kda_layers"] else "mla" for i in range(num_layers))


def _check_depth_keys(r: _Reader, num_layers: int) -> None:
    """Keys counted in layers must fit the depth (a block or dense prefix longer than the model is a typo)."""
    for key in ("first_k_dense_replace", "attn_res_block_size"):
        value = r.int(key, minimum=0 if key == "first_k_dense_replace" else 1)
        if value > num_layers:
            raise ConfigError(
                f"config key {r.prefix}.{key}={value}: expected at most num_hidden_layers={num_layers}"
            )


def _check_mxfp4_widths(r: _Reader, quantization: Any) -> None:
    """MXFP4-packed routed experts scale blocks of 32 inputs: their input widths must be multiples of 32."""
    if not isinstance(quantization, dict) or "mxfp4" not in str(quantization.get("format", "")):
        return
    for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
        value = r.int(key)
        if value % _MXFP4_BLOCK:
            raise ConfigError(
                f"config key {r.prefix}.{key}={value}: the MXFP4-quantized routed experts need a multiple of "
                f"{_MXFP4_BLOCK}"
            )


def _parse_text_config(text: dict[str, Any], top: dict[str, Any]) -> K3Config:
    r = _Reader(text, "text_config" if text is not top else "config")
    linear = r.sub("linear_attn_config")
    num_layers = r.int("num_hidden_layers")
    num_experts = r.int("num_experts")

    r.require("hidden_act", ("situ",))
    r.require("moe_router_activation_func", ("sigmoid",))
    r.require("topk_method", ("noaux_tc",))
    r.require("mla_use_nope", (True,))
    r.require("mla_use_output_gate", (True,))
    r.require("tie_word_embeddings", (False,), default=False)
    _Reader(top, "config").require("tie_word_embeddings", (False,), default=False)
    r.require("moe_layer_freq", (1,), default=1)
    linear.require("use_full_rank_gate", (True,))
    if r.bool("use_grouped_topk", default=False):
        groups = r.int("num_expert_group", default=1)
        if r.int("topk_group", default=groups) != groups:
            raise ConfigError(
                f"config keys {r.prefix}.topk_group/num_expert_group: group-limited routing is not supported "
                "(K3 uses one group); expected topk_group == num_expert_group"
            )
        if num_experts % groups:
            raise ConfigError(
                f"config key {r.prefix}.num_expert_group={groups}: expected a divisor of num_experts={num_experts}"
            )
    heads = r.int("num_attention_heads")
    if r.int("num_key_value_heads", default=heads) != heads:
        raise ConfigError(f"config key {r.prefix}.num_key_value_heads must equal num_attention_heads for MLA")
    lower_bound = linear.float("gate_lower_bound", rule="negative")
    # absent, null or 0: no cap on the up projection
    linear_beta = r.float("activation_situ_linear_beta", default=0.0, rule="non-negative") or None
    dtype = top.get("dtype", top.get("torch_dtype", text.get("dtype", "bfloat16")))
    _check_depth_keys(r, num_layers)
    _check_mxfp4_widths(r, text.get("quantization_config", top.get("quantization_config")))

    return K3Config(
        vocab_size=r.int("vocab_size"),
        hidden_size=r.int("hidden_size"),
        num_hidden_layers=num_layers,
        mixer_kinds=_mixer_kinds(linear, num_layers),
        kda_num_heads=linear.int("num_heads"),
        kda_head_dim=linear.int("head_dim"),
        kda_conv_kernel=linear.int("short_conv_kernel_size"),
        kda_gate_lower_bound=lower_bound,
        mla_num_heads=heads,
        q_lora_rank=r.int("q_lora_rank"),
        kv_lora_rank=r.int("kv_lora_rank"),
        qk_nope_head_dim=r.int("qk_nope_head_dim"),
        qk_rope_head_dim=r.int("qk_rope_head_dim", minimum=0),
        v_head_dim=r.int("v_head_dim"),
        first_k_dense_replace=r.int("first_k_dense_replace", minimum=0),
        intermediate_size=r.int("intermediate_size"),
        num_experts=num_experts,
        num_experts_per_token=r.int("num_experts_per_token"),
        moe_intermediate_size=r.int("moe_intermediate_size"),
        routed_expert_hidden_size=r.int("routed_expert_hidden_size"),
        latent_moe_use_norm=r.bool("latent_moe_use_norm"),
        num_shared_experts=r.int("num_shared_experts", minimum=0),
        moe_renormalize=r.bool("moe_renormalize"),
        routed_scaling_factor=r.float("routed_scaling_factor"),
        situ_beta=r.float("activation_situ_beta"),
        situ_linear_beta=linear_beta,
        attn_res_block_size=r.int("attn_res_block_size"),
        rms_norm_eps=r.float("rms_norm_eps"),
        bos_token_id=top.get("bos_token_id", text.get("bos_token_id")),
        eos_token_id=top.get("eos_token_id", text.get("eos_token_id")),
        pad_token_id=top.get("pad_token_id", text.get("pad_token_id")),
        dtype=str(dtype),
    )


def _parse_vision_config(v: _Reader, text_hidden: int) -> VisionConfig:
    for key, allowed in (("norm_type", "rmsnorm"), ("mlp_type", "mlp2"), ("merge_type", "sd2_tpool"),
                         ("mm_projector_type", "patchmergerv2"), ("pos_emb_type", "divided_fixed"),
                         ("pos_emb_interpolation_mode", "bilinear")):
        v.require(key, (allowed,))
    for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
        v.require(key, (False,), default=False)
    v.require("merge_kernel_size", ([2, 2],))
    hidden, heads, qkv = v.int("vt_hidden_size"), v.int("vt_num_attention_heads"), v.int("qkv_hidden_size")
    if v.int("mm_hidden_size", default=hidden) != hidden:
        raise ConfigError(f"config key {v.prefix}.mm_hidden_size must equal vt_hidden_size={hidden}")
    if qkv % heads or (qkv // heads) % 4:
        raise ConfigError(f"config key {v.prefix}.qkv_hidden_size={qkv}: expected vt_num_attention_heads={heads} "
                          "heads of a width divisible by 4 (2-D rotary embedding)")
    if hidden % 2:
        raise ConfigError(f"config key {v.prefix}.vt_hidden_size={hidden}: expected an even width")
    if v.int("text_hidden_size") != text_hidden:
        raise ConfigError(f"config key {v.prefix}.text_hidden_size must equal text_config.hidden_size={text_hidden}")
    return VisionConfig(
        patch_size=v.int("patch_size"), hidden_size=hidden, num_layers=v.int("vt_num_hidden_layers"),
        num_heads=heads, qkv_hidden_size=qkv, intermediate_size=v.int("vt_intermediate_size"),
        pos_emb_height=v.int("init_pos_emb_height"), pos_emb_width=v.int("init_pos_emb_width"),
        pos_emb_time=v.int("init_pos_emb_time"), text_hidden_size=text_hidden,
        projector_eps=v.float("projector_ln_eps"),
    )
