"""KimiK3Config: parsing of K3 (nested text_config) and flat Kimi-Linear configs, presets, validation."""
import dataclasses
import json

import numpy as np
import pytest

from jaxk3.config import KimiK3Config


def test_k3_real_size_schedule_and_dims():
    cfg = KimiK3Config.k3()
    # docs/SPEC.md §1.2: MLA at 0-based {3,7,…,91} ∪ {92}; KDA elsewhere; dense layer 0 then MoE
    assert cfg.mla_layers == tuple(i for i in range(92) if i % 4 == 3) + (92,)
    assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24
    assert cfg.layer_ffn[0] == "mlp" and set(cfg.layer_ffn[1:]) == {"moe"}
    assert cfg.num_attn_res_blocks == 8 and cfg.attn_res_block_size == 12
    assert cfg.latent_dim == 576 and cfg.kda_dim == 12288 and cfg.qk_head_dim == 192
    assert cfg.moe_hidden == 3584 and cfg.shared_intermediate_size == 6144
    assert cfg.padded_vocab(8) == 163840  # already a multiple of 64*8: no padding
    assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate and cfg.hidden_act == "situ"
    for tp in (1, 2, 4, 8, 16):
        cfg.validate_tp(tp)
    hash(cfg)  # static: usable as a jit static argument


def test_tiny_k3_matches_spec_7_1():
    cfg = KimiK3Config.tiny_k3()
    assert cfg.mla_layers == (3, 6, 7) and cfg.kda_layers == (0, 1, 2, 4, 5)
    assert cfg.num_attn_res_blocks == 3
    assert cfg.padded_vocab(1) == 1024 and cfg.padded_vocab(8) == 1024
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim) == (64, 32, 16, 8)
    assert cfg.routed_expert_hidden_size == 128 and cfg.num_shared_experts == 2
    for tp in (1, 2, 4, 8):
        cfg.validate_tp(tp)


def test_tiny_kimi_linear_mode():
    cfg = KimiK3Config.tiny_kimi_linear()
    assert cfg.q_lora_rank is None and not cfg.mla_use_output_gate and cfg.attn_res_block_size is None
    assert cfg.gate_lower_bound is None and not cfg.use_full_rank_gate
    assert cfg.routed_expert_hidden_size is None and cfg.hidden_act == "silu"
    assert cfg.routed_scaling_factor == pytest.approx(2.446)


def test_nested_text_config_and_file(tmp_path):
    flat = KimiK3Config.tiny_k3().to_hf_dict()
    nested = {"model_type": "kimi_k3", "text_config": flat, "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert KimiK3Config.from_pretrained(tmp_path) == KimiK3Config.tiny_k3()
    assert KimiK3Config.from_pretrained(str(tmp_path / "config.json")) == KimiK3Config.tiny_k3()
    assert KimiK3Config.from_pretrained(flat) == KimiK3Config.tiny_k3()


def test_transformers_style_aliases():
    """transformers' KimiLinearConfig.to_dict() spelling: layer_types, linear_*, n_shared_experts, …"""
    d = dict(vocab_size=100, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
             mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=4, linear_head_dim=16,
             linear_conv_kernel_dim=4, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.0, hidden_act="silu")
    cfg = KimiK3Config.from_pretrained(d)
    assert cfg.mla_layers == (2,) and cfg.layer_ffn == ("mlp", "moe", "moe", "moe")
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.num_experts, cfg.num_experts_per_token) == (4, 16, 8, 2)


@pytest.mark.parametrize("change, field", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(linear_attn_config=dict(full_attn_layers=[4, 7, 8], kda_layers=[1, 2, 3, 5], num_heads=8, head_dim=32)),
     "full_attn_layers/kda_layers"),
    (dict(linear_attn_config=dict(full_attn_layers=[4, 7, 8, 1], kda_layers=[1, 2, 3, 5, 6], num_heads=8,
                                  head_dim=32)), "linear_attn_config"),
    (dict(linear_attn_config=dict(full_attn_layers=[4, 7, 9], kda_layers=[1, 2, 3, 5, 6], num_heads=8,
                                  head_dim=32)), "out of 1..8"),
    (dict(num_experts_per_token=17), "num_experts_per_token"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace("+", r"\+")):
        KimiK3Config.tiny_k3(**change)


def test_validate_tp_names_the_field():
    cfg = KimiK3Config.tiny_k3()
    with pytest.raises(ValueError, match="kda num_heads = 8 is not divisible by the TP size 3"):
        cfg.validate_tp(3)
    with pytest.raises(ValueError, match="tp: must be a positive int"):
        cfg.validate_tp(0)
    odd = KimiK3Config.tiny_k3(kv_lora_rank=30, qk_rope_head_dim=6)  # latent 36: not divisible by 8
    with pytest.raises(ValueError, match=r"kv_lora_rank \+ qk_rope_head_dim"):
        odd.validate_tp(8)
    odd.validate_tp(8, shard_latent=False)  # replicated latent: no constraint
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        KimiK3Config.tiny_k3(moe_intermediate_size=60).validate_tp(8)


# ------------------------------------------------------- max_position_embeddings, cache bytes, numpy ints
def test_max_position_embeddings_read_and_round_tripped(tmp_path):
    """docs/SPEC.md §1.1: K3 and Kimi-Linear-48B use 1048576; unknown (None) when a config lacks it."""
    k3 = KimiK3Config.k3()
    assert k3.max_position_embeddings == 1048576
    assert KimiK3Config.from_pretrained(k3.to_hf_dict()) == k3
    nested = {"model_type": "kimi_k3", "text_config": k3.to_hf_dict()}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert KimiK3Config.from_pretrained(tmp_path) == k3
    hash(k3)

    tiny = KimiK3Config.tiny_k3()
    assert tiny.max_position_embeddings is None and "max_position_embeddings" not in tiny.to_hf_dict()
    assert KimiK3Config.from_pretrained(tiny.to_hf_dict()) == tiny
    small = KimiK3Config.tiny_k3(max_position_embeddings=4096)
    assert small.max_position_embeddings == 4096 and small != tiny and hash(small) != hash(tiny)
    assert KimiK3Config.from_pretrained(small.to_hf_dict()) == small
    # transformers' KimiLinearConfig.to_dict() spells it model_max_length (its attribute_map)
    d = tiny.to_hf_dict()
    d["model_max_length"] = 8192
    assert KimiK3Config.from_pretrained(d).max_position_embeddings == 8192
    assert KimiK3Config.tiny_k3(max_position_embeddings=4096.0).max_position_embeddings == 4096
    np_mpe = dataclasses.replace(tiny, max_position_embeddings=np.int64(4096))
    assert type(np_mpe.max_position_embeddings) is int and np_mpe == small and hash(np_mpe) == hash(small)


@pytest.mark.parametrize("bad", [0, -1, "1M", True, 1.5, [4096]])
def test_bad_max_position_embeddings_is_named(bad):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        KimiK3Config.tiny_k3(max_position_embeddings=bad)


def test_wrong_json_types_are_value_errors():
    """A field of the wrong JSON type is a ValueError (a config error), not a TypeError traceback."""
    with pytest.raises(ValueError):
        KimiK3Config.tiny_k3(attn_res_block_size="3")
    with pytest.raises(ValueError):
        KimiK3Config.tiny_k3(linear_attn_config=[1, 2])



def test_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: must be a JSON object, got an array"):
        KimiK3Config.from_pretrained(tmp_path)


def test_validate_tp_accepts_numpy_integers():
    """Was: load_model(tp=np.int64(4)) said "must be an int ..., got np.int64(4)" (the config part)."""
    cfg = KimiK3Config.tiny_k3()
    for tp in (np.int64(4), np.int32(2), np.uint8(8)):
        cfg.validate_tp(tp)
    with pytest.raises(ValueError, match="kda num_heads = 8 is not divisible by the TP size 3"):
        cfg.validate_tp(np.int64(3))
    for bad in (4.0, True, "4", None, np.float32(4)):
        with pytest.raises(ValueError, match="tp: must be a positive int"):
            cfg.validate_tp(bad)


def test_cache_bytes_per_rank_k3():
    """K3: the replicated latent cache is 24 MLA layers x 576 x 2 B = 27648 B per token per row
    (docs/SPEC.md §7.2); the KDA state 69 x 96/tp heads x 128^2 x 4 B; the conv window 69 x 3 x 12288/tp x 3."""
    cfg = KimiK3Config.k3()
    kda8 = 69 * 12 * 128 * 128 * 4 + 69 * 3 * (12288 // 8) * 3 * 2 + 4
    assert cfg.cache_bytes_per_rank(1, 1, 8, 2) == 27648 + kda8
    assert cfg.cache_bytes_per_rank(1, 1025, 8, 2) - cfg.cache_bytes_per_rank(1, 1, 8, 2) == 27648 * 1024
    assert cfg.cache_bytes_per_rank(np.int64(2), np.int64(64), np.int64(8), np.int64(2)) == \
        2 * cfg.cache_bytes_per_rank(1, 64, 8, 2)
    # a million positions x 8 rows: no overflow (Python ints), ~217 GiB of latent cache per rank
    assert cfg.cache_bytes_per_rank(8, 1 << 20, 8, 2) > 27648 * 8 * (1 << 20)
    with pytest.raises(ValueError, match="batch"):
        cfg.cache_bytes_per_rank(0, 64, 8, 2)


@pytest.mark.parametrize("ring", [False, True])
def test_cache_bytes_per_rank_matches_the_model_cache(ring, monkeypatch):
    """The same arrays as the model's cache declaration (jaxk3.model.cache_abstract: shape, dtype
    class, TP dimension), counted per rank; with the KDA conv window as the shift form or the ring."""
    import jax

    from jaxk3.kernels import kda_decode
    from jaxk3.model import cache_abstract

    monkeypatch.setattr(kda_decode, "RING", ring)
    for cfg in (KimiK3Config.tiny_k3(), KimiK3Config.tiny_kimi_linear()):
        for dtype in (np.float32, np.float16):
            for tp in (1, 2, 8):
                total = 0
                for b in jax.tree.leaves(cache_abstract(cfg, 3, 128), is_leaf=lambda x: hasattr(x, "tp_dim")):
                    shape = list(b.shape)
                    if b.tp_dim is not None:
                        shape[b.tp_dim] //= tp
                    total += int(np.prod(shape)) * b.np_dtype(dtype).itemsize
                assert cfg.cache_bytes_per_rank(3, 128, tp, np.dtype(dtype).itemsize, ring=ring) == total, (cfg, dtype, tp)


# ------------------------------------------------------- issue 20: every field checked, named, before loading
_LAC = dict(full_attn_layers=[4, 7, 8], kda_layers=[1, 2, 3, 5, 6], num_heads=8, head_dim=32,
            short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True)


@pytest.mark.parametrize("change, message", [
    # types: bools are not ints, floats are refused (not truncated), strings are not numbers
    (dict(hidden_size=256.5), "hidden_size: must be an integer, got 256.5 (not rounded)"),
    (dict(hidden_size=256.0), "hidden_size: must be an integer, got 256.0 (write 256)"),
    (dict(vocab_size=True), "vocab_size: must be an integer, got true (a bool)"),
    (dict(num_experts="16"), 'num_experts: must be an integer, got "16"'),
    (dict(num_experts_per_tok=4.0, num_experts_per_token=None), "num_experts_per_tok: must be an integer"),
    (dict(rms_norm_eps="1e-5"), 'rms_norm_eps: must be a number, got "1e-5"'),
    (dict(routed_scaling_factor=False), "routed_scaling_factor: must be a number, got false"),
    (dict(tie_word_embeddings=1), "tie_word_embeddings: must be true or false, got 1"),
    (dict(moe_renormalize="yes"), 'moe_renormalize: must be true or false, got "yes"'),
    (dict(hidden_act=3), "hidden_act: must be a string, got 3"),
    (dict(linear_attn_config=[1, 2]), "linear_attn_config: must be a JSON object, got an array"),
    (dict(linear_attn_config=dict(_LAC, kda_layers=[1, 2, 3, 5, 6.0])),
     "linear_attn_config.kda_layers: must be an integer, got 6.0"),
    (dict(text_config=[1]), "text_config: must be a JSON object, got an array"),
    # ranges
    (dict(num_experts_per_token=0), "num_experts_per_token: must be >= 1, got 0"),
    (dict(hidden_size=0), "hidden_size: must be >= 1, got 0"),
    (dict(num_attention_heads=-8), "num_attention_heads: must be >= 1, got -8"),
    (dict(qk_rope_head_dim=0), "qk_rope_head_dim: must be >= 1, got 0"),
    (dict(v_head_dim=-1), "v_head_dim: must be >= 1, got -1"),
    (dict(linear_attn_config=dict(_LAC, num_heads=0)), "linear_attn_config.num_heads: must be >= 1, got 0"),
    (dict(linear_attn_config=dict(_LAC, head_dim=-32)), "linear_attn_config.head_dim: must be >= 1, got -32"),
    (dict(linear_attn_config=dict(_LAC, gate_lower_bound=2.0)), "linear_attn_config.gate_lower_bound: "),
    (dict(q_lora_rank=0), "q_lora_rank: must be >= 1 or null, got 0"),
    (dict(rms_norm_eps=0), "rms_norm_eps: must be a finite number > 0, got 0.0"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor: must be a finite number > 0, got nan"),
    (dict(num_shared_experts=-1), "num_shared_experts: must be >= 0, got -1"),
    (dict(moe_layer_freq=0), "moe_layer_freq: must be >= 1, got 0"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace: must be >= 0, got -1"),
    (dict(num_hidden_layers=0), "num_hidden_layers: must be >= 1, got 0"),
    (dict(pad_token_id=1000), r"pad_token_id: 1000 is outside the vocabulary \[0, 1000\)"),
    (dict(eos_token_id=[5, -1]), r"eos_token_id: -1 is outside the vocabulary"),
    (dict(eos_token_id=[5, True]), "eos_token_id: must be an integer, got true"),
    # consistency: top-k <= experts, groups dividing experts, group-limited top-k able to fill k
    (dict(num_experts_per_token=17), "num_experts_per_token: 17 > num_experts 16"),
    (dict(num_expert_group=3), "num_expert_group: 3 groups do not divide num_experts 16"),
    (dict(n_group=5, num_expert_group=None), "n_group: 5 groups do not divide num_experts 16"),
    (dict(num_expert_group=2, topk_group=3), "topk_group: 3 > num_expert_group 2"),
    (dict(num_expert_group=16), "num_expert_group: 16 groups of num_experts 16 leave 1 expert"),
    (dict(num_expert_group=8, topk_group=1), "topk_group: 1 groups of 2 experts hold fewer than num_experts_per_token 4"),
])
def test_every_field_is_checked_and_named(change, message):
    """Was: `num_experts_per_token: 0` loaded and changed the tokens, `hidden_size: 256.5` ran as 256, a
    0 in linear_attn_config.num_heads became the default 32, moe_layer_freq 0 a ZeroDivisionError."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       if "\\" not in message else message):
        KimiK3Config.tiny_k3(**change)


def test_errors_name_the_file(tmp_path):
    d = KimiK3Config.tiny_k3().to_hf_dict()
    d["hidden_size"] = 256.5
    (tmp_path / "config.json").write_text(json.dumps({"text_config": d}))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: hidden_size: must be an integer, got 256.5"):
        KimiK3Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: not valid JSON"):
        KimiK3Config.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^/no/such/config.json: cannot read the config \(No such file"):
        KimiK3Config.from_pretrained("/no/such/config.json")


def test_direct_construction_is_checked_too():
    """dataclasses.replace and the constructor run the same checks (bench slices, experts formats)."""
    cfg = KimiK3Config.tiny_k3()
    with pytest.raises(ValueError, match="num_experts_per_token: 4 > num_experts 2"):
        dataclasses.replace(cfg, num_experts=2)
    with pytest.raises(ValueError, match="hidden_size: must be an integer, got 256.5"):
        dataclasses.replace(cfg, hidden_size=256.5)
    same = dataclasses.replace(cfg, hidden_size=np.int64(256), rms_norm_eps=np.float64(1e-5),
                               routed_scaling_factor=1)
    assert type(same.hidden_size) is int and type(same.routed_scaling_factor) is float
    assert type(same.rms_norm_eps) is float
    assert same == cfg and hash(same) == hash(cfg)


def test_eos_token_id_list_keeps_every_id():
    """Was: config.py kept eos[0] of a list.  eos_token_ids has them all; eos_token_id is the first."""
    cfg = KimiK3Config.tiny_k3(eos_token_id=[7, 9, 11])
    assert cfg.eos_token_ids == (7, 9, 11) and cfg.eos_token_id == 7
    assert cfg.to_hf_dict()["eos_token_id"] == [7, 9, 11]
    assert KimiK3Config.from_pretrained(cfg.to_hf_dict()) == cfg
    one = KimiK3Config.tiny_k3(eos_token_id=9)
    assert one.eos_token_ids == (9,) and one.eos_token_id == 9 and one.to_hf_dict()["eos_token_id"] == 9
    none = KimiK3Config.tiny_k3()
    assert none.eos_token_ids == () and none.eos_token_id is None
    assert KimiK3Config.tiny_k3(eos_token_id=[]).eos_token_ids == ()


def test_presets_pass_their_own_checks():
    from jaxk3.tools.bench_decode import load_config

    for name in ("k3", "kimi-linear-48b", "tiny"):
        cfg = load_config(name)
        assert KimiK3Config.from_pretrained(cfg.to_hf_dict()) == cfg
    assert KimiK3Config.tiny_kimi_linear() == KimiK3Config.from_pretrained(KimiK3Config.tiny_kimi_linear().to_hf_dict())
