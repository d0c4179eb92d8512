"""KimiK3Config: parsing of K3 (nested text_config) and flat Kimi-Linear configs, presets, validation."""
import json

import pytest

from jaxk3.config import KimiK3Config


def test_k3_real_size_schedule_and_dims():
    cfg = KimiK3Config.k3()
    # spec §1.2: MLA at 0-based {3,7,…,91} ∪ {92}; KDA elsewhere; dense layer 0 then MoE
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
