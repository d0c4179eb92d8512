"""`KimiK3Config`: the static, hashable model configuration (docs/SPEC.md §1.1, §7.1).

One class serves Kimi-K3 (HF `config.json` with a nested `text_config`, `model_type`
"kimi_linear" inside) and flat Kimi-Linear configs, like vLLM's `KimiLinearForCausalLM`.  The K3
paths switch on when `gate_lower_bound` / `use_full_rank_gate` / `q_lora_rank` /
`attn_res_block_size` / `routed_expert_hidden_size` are set.

The layer schedule is stored resolved, 0-based, as two tuples of strings:
`layer_attn[l] in {"kda", "mla"}` and `layer_ffn[l] in {"mlp", "moe"}`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
from typing import Any, Mapping

_ACTIVATIONS = ("silu", "situ")
EXPERTS_FORMATS = ("dense", "mxfp4")
MXFP4_GROUP = 32  # values per E8M0 scale (jaxk3.mxfp4.GROUP)


@dataclasses.dataclass(frozen=True)
class KimiK3Config:
    # -- trunk
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    layer_attn: tuple[str, ...]  # per layer, 0-based: "kda" | "mla"
    layer_ffn: tuple[str, ...]  # per layer, 0-based: "mlp" | "moe"
    attn_res_block_size: int | None  # None: plain residual stream (Kimi-Linear)
    tie_word_embeddings: bool
    # -- MLA (NoPE)
    num_attention_heads: int
    q_lora_rank: int | None  # None: full-rank q_proj (Kimi-Linear)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    # -- KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float | None  # None: softplus gate (Kimi-Linear)
    use_full_rank_gate: bool  # g_proj (K3) vs g_a_proj/g_b_proj (Kimi-Linear)
    # -- FFN / MoE
    intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None  # None: experts act on the full hidden (no latent path)
    latent_moe_use_norm: bool
    moe_router_activation_func: str
    use_grouped_topk: bool  # DeepSeek-V3 group-limited selection (a no-op with one group)
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    hidden_act: str
    activation_situ_beta: float
    activation_situ_linear_beta: float
    # -- token ids (informational)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # -- context length: prompt + generated tokens a model supports (HF `max_position_embeddings`;
    # K3 and Kimi-Linear-48B: 1048576, docs/SPEC.md §1.1).  None: unknown (not checked).
    max_position_embeddings: int | None = None
    # -- how the routed experts are held on the device (not a hub field; chosen at load):
    # "dense" (the model dtype) or "mxfp4" (packed E2M1 nibbles + E8M0 scales, as K3 ships them;
    # jaxk3.layers.moe.MXFP4).  load_model picks "mxfp4" where the checkpoint has it.
    experts_format: str = "dense"

    # ------------------------------------------------------------------ derived
    @property
    def kda_dim(self) -> int:
        """H_kda * d: width of q/k/v/g projections of a KDA layer."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA latent-cache entry: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_hidden(self) -> int:
        """Input width of the routed experts (the latent width when latent MoE is on)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.layer_attn) if a == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.layer_attn) if a == "mla")

    @property
    def num_attn_res_blocks(self) -> int:
        b = self.attn_res_block_size
        return 0 if b is None else math.ceil(self.num_hidden_layers / b)

    def padded_vocab(self, tp: int) -> int:
        """Vocab rounded up to a multiple of 64*tp (vLLM pads to 64, then splits evenly)."""
        m = 64 * tp
        return -(-self.vocab_size // m) * m

    # --------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        if len(self.layer_attn) != L or len(self.layer_ffn) != L:
            raise ValueError(
                f"layer_attn/layer_ffn: need {L} entries (num_hidden_layers), got "
                f"{len(self.layer_attn)}/{len(self.layer_ffn)}")
        if any(a not in ("kda", "mla") for a in self.layer_attn):
            raise ValueError(f"layer_attn: entries must be 'kda' or 'mla', got {self.layer_attn}")
        if any(f not in ("mlp", "moe") for f in self.layer_ffn):
            raise ValueError(f"layer_ffn: entries must be 'mlp' or 'moe', got {self.layer_ffn}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: unknown activation {self.hidden_act!r}; known: {_ACTIVATIONS}")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(
                f"moe_router_activation_func: only 'sigmoid' is implemented, got {self.moe_router_activation_func!r}")
        if self.experts_format not in EXPERTS_FORMATS:
            raise ValueError(f"experts_format: must be one of {EXPERTS_FORMATS}, got {self.experts_format!r}")
        if self.experts_format == "mxfp4" and "moe" in self.layer_ffn:
            for name, cols in (("routed expert input width (moe_hidden)", self.moe_hidden),
                               ("moe_intermediate_size", self.moe_intermediate_size)):
                if cols % MXFP4_GROUP:
                    raise ValueError(f"experts_format='mxfp4': {name} = {cols} is not a multiple of the MXFP4 "
                                     f"group {MXFP4_GROUP}")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size: must be >= 1, got {self.attn_res_block_size}")
        if "mla" in self.layer_attn and not self.mla_use_nope:
            raise ValueError("mla_use_nope: only NoPE MLA is implemented (Kimi-K3/Kimi-Linear); got false")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token: {self.num_experts_per_token} > num_experts {self.num_experts}")
        if self.num_experts % self.num_expert_group or self.topk_group > self.num_expert_group:
            raise ValueError(
                f"num_expert_group/topk_group: num_experts {self.num_experts} must divide into "
                f"{self.num_expert_group} groups and topk_group {self.topk_group} <= groups")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "short_conv_kernel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_position_embeddings is not None:  # numpy integers are stored as int (hash, equality, JSON)
            try:
                mpe = _positive_int("max_position_embeddings", self.max_position_embeddings)
            except ValueError:
                raise ValueError(f"max_position_embeddings: must be a positive int or null, "
                                 f"got {self.max_position_embeddings!r}") from None
            object.__setattr__(self, "max_position_embeddings", mpe)

    def validate_tp(self, tp: int, *, shard_latent: bool = True) -> None:
        """Raise ValueError naming the field when a sharded dimension does not divide by `tp`
        (any integer type: Python or numpy)."""
        tp = _positive_int("tp", tp)
        checks = []
        if self.kda_layers:
            checks.append(("kda num_heads", self.kda_num_heads))
        if self.mla_layers:
            checks.append(("num_attention_heads", self.num_attention_heads))
            if shard_latent:
                if self.q_lora_rank is not None:
                    checks.append(("q_lora_rank (shard_latent=True)", self.q_lora_rank))
                checks.append(("kv_lora_rank + qk_rope_head_dim (shard_latent=True)", self.latent_dim))
        if "mlp" in self.layer_ffn:
            checks.append(("intermediate_size", self.intermediate_size))
        if "moe" in self.layer_ffn:
            checks.append(("moe_intermediate_size", self.moe_intermediate_size))
            if self.experts_format == "mxfp4":  # w2's packed input columns split in whole scale groups
                checks.append((f"moe_intermediate_size / {MXFP4_GROUP} (experts_format='mxfp4': w2's scale "
                               "groups)", self.moe_intermediate_size // MXFP4_GROUP))
            if shard_latent and self.routed_expert_hidden_size is not None:
                checks.append(("routed_expert_hidden_size (shard_latent=True)", self.routed_expert_hidden_size))
            if self.num_shared_experts:
                checks.append(("moe_intermediate_size * num_shared_experts", self.shared_intermediate_size))
        for name, value in checks:
            if value % tp:
                raise ValueError(f"{name} = {value} is not divisible by the TP size {tp}")

    def cache_bytes_per_rank(self, batch: int, max_len: int, tp: int, dtype_bytes: int) -> int:
        """Bytes of the decode cache one TP rank holds for `batch` rows (the rows of this rank's
        data-parallel shard) of up to `max_len` positions, activations of `dtype_bytes` bytes:

          MLA latent cache  num_mla_layers x batch x max_len x (kv_lora_rank + qk_rope_head_dim)
                            x dtype_bytes, replicated on every TP rank
          KDA state         num_kda_layers x batch x (kda_num_heads / tp) x kda_head_dim^2 x 4 (fp32)
          KDA conv window   num_kda_layers x batch x 3 x (kda_dim / tp) x (short_conv_kernel_size - 1)
                            x dtype_bytes
          lengths           batch x 4

        The arrays `jaxk3.model.cache_abstract` declares; Python ints, so no overflow at any size."""
        batch = _positive_int("batch", batch)
        max_len = _positive_int("max_len", max_len)
        tp = _positive_int("tp", tp)
        dtype_bytes = _positive_int("dtype_bytes", dtype_bytes)
        n_kda, n_mla = len(self.kda_layers), len(self.mla_layers)
        heads = -(-self.kda_num_heads // tp)
        mla = n_mla * batch * max_len * self.latent_dim * dtype_bytes
        state = n_kda * batch * heads * self.kda_head_dim ** 2 * 4
        conv = n_kda * batch * 3 * heads * self.kda_head_dim * (self.short_conv_kernel_size - 1) * dtype_bytes
        return mla + state + conv + batch * 4

    # -------------------------------------------------------------- constructors
    @classmethod
    def from_pretrained(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "KimiK3Config":
        """From a HF model dir / config.json path / dict.  K3's nested `text_config` is unwrapped."""
        if isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            with open(p) as f:
                raw = json.load(f)
        if not isinstance(raw, Mapping):
            raise ValueError(f"config: must be a JSON object, got {type(raw).__name__}")
        if isinstance(raw.get("text_config"), Mapping):
            raw = dict(raw["text_config"])
        try:
            return cls._from_flat(raw)
        except (TypeError, AttributeError) as e:  # a field of the wrong JSON type: still a config error
            raise ValueError(f"config: a field has the wrong type ({e})") from None

    @classmethod
    def _from_flat(cls, c: Mapping[str, Any]) -> "KimiK3Config":
        lac = dict(c.get("linear_attn_config") or {})

        def get(*names, default=None, src=(lac, c)):
            for d in src:
                for n in names:
                    if n in d and d[n] is not None:
                        return d[n]
            return default

        def need(*names):
            v = get(*names)
            if v is None:
                raise ValueError(f"{names[0]}: missing from the config")
            return v

        L = int(need("num_hidden_layers"))
        # attention schedule: linear_attn_config (1-based) > layer_types > every 4th MLA
        full, kda = lac.get("full_attn_layers"), lac.get("kda_layers")
        if full is not None or kda is not None:
            full, kda = list(full or []), list(kda or [])
            bad = [i for i in full + kda if not 1 <= int(i) <= L]
            if bad:
                raise ValueError(f"linear_attn_config.full_attn_layers/kda_layers: 1-based ids out of 1..{L}: {bad}")
            if set(full) & set(kda):
                raise ValueError(
                    f"linear_attn_config: layers in both full_attn_layers and kda_layers: {sorted(set(full) & set(kda))}")
            if len(set(full)) + len(set(kda)) != L:
                missing = sorted(set(range(1, L + 1)) - set(full) - set(kda))
                raise ValueError(
                    f"linear_attn_config.full_attn_layers/kda_layers: must cover layers 1..{L} once; missing {missing}")
            layer_attn = tuple("mla" if (i + 1) in set(full) else "kda" for i in range(L))
        elif c.get("layer_types") is not None:
            lt = list(c["layer_types"])
            if len(lt) != L or any(t not in ("full_attention", "linear_attention") for t in lt):
                raise ValueError(f"layer_types: need {L} of 'full_attention'/'linear_attention', got {lt}")
            layer_attn = tuple("mla" if t == "full_attention" else "kda" for t in lt)
        else:
            layer_attn = tuple("mla" if i and i % 4 == 0 else "kda" for i in range(L))

        fkd = int(get("first_k_dense_replace", default=1))
        freq = int(get("moe_layer_freq", default=1))
        if c.get("mlp_layer_types") is not None:
            mt = list(c["mlp_layer_types"])
            if len(mt) != L or any(t not in ("dense", "sparse") for t in mt):
                raise ValueError(f"mlp_layer_types: need {L} of 'dense'/'sparse', got {mt}")
            layer_ffn = tuple("moe" if t == "sparse" else "mlp" for t in mt)
        else:
            layer_ffn = tuple("moe" if (i >= fkd and i % freq == 0) else "mlp" for i in range(L))

        eos = c.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        act = str(c.get("hidden_act", "silu"))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=L,
            rms_norm_eps=float(get("rms_norm_eps", default=1e-5)),
            layer_attn=layer_attn,
            layer_ffn=layer_ffn,
            attn_res_block_size=get("attn_res_block_size"),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            num_attention_heads=int(need("num_attention_heads")),
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=int(get("kv_lora_rank", default=512)),
            qk_nope_head_dim=int(get("qk_nope_head_dim", default=128)),
            qk_rope_head_dim=int(get("qk_rope_head_dim", default=64)),
            v_head_dim=int(get("v_head_dim", default=128)),
            mla_use_nope=bool(get("mla_use_nope", default=True)),
            mla_use_output_gate=bool(get("mla_use_output_gate", default=False)),
            kda_num_heads=int(get("num_heads", "linear_num_heads", src=(lac,)) or c.get("linear_num_heads", 32)),
            kda_head_dim=int(get("head_dim", src=(lac,)) or c.get("linear_head_dim", 128)),
            short_conv_kernel_size=int(
                get("short_conv_kernel_size", src=(lac,)) or c.get("linear_conv_kernel_dim", 4)),
            gate_lower_bound=(None if get("gate_lower_bound") is None else float(get("gate_lower_bound"))),
            use_full_rank_gate=bool(get("use_full_rank_gate", default=False)),
            intermediate_size=int(need("intermediate_size")),
            num_experts=int(get("num_experts", "num_local_experts", "n_routed_experts", default=0)),
            num_experts_per_token=int(get("num_experts_per_token", "num_experts_per_tok", default=1)),
            num_shared_experts=int(get("num_shared_experts", "n_shared_experts", default=0)),
            moe_intermediate_size=int(get("moe_intermediate_size", default=0)),
            routed_expert_hidden_size=get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(get("latent_moe_use_norm", default=get("routed_expert_hidden_size") is not None)),
            moe_router_activation_func=str(get("moe_router_activation_func", default="sigmoid")),
            use_grouped_topk=bool(get("use_grouped_topk", default=True)),
            num_expert_group=int(get("num_expert_group", "n_group", default=1)),
            topk_group=int(get("topk_group", default=1)),
            moe_renormalize=bool(get("moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
            hidden_act=act,
            activation_situ_beta=float(get("activation_situ_beta", default=4.0)),
            activation_situ_linear_beta=float(get("activation_situ_linear_beta", default=25.0)),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=c.get("pad_token_id"),
            # transformers' KimiLinearConfig stores it as `model_max_length` (its attribute_map)
            max_position_embeddings=_optional_int(get("max_position_embeddings", "model_max_length")),
        )

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny_k3(cls, **overrides: Any) -> "KimiK3Config":
        """docs/SPEC.md §7.1 tiny K3-mode config (every sharded dim divides by 1, 2, 4, 8)."""
        d = dict(_TINY_K3)
        d.update(overrides)
        return cls.from_pretrained(d)

    @classmethod
    def tiny_kimi_linear(cls, **overrides: Any) -> "KimiK3Config":
        """docs/SPEC.md §7.1 "Kimi-Linear mode": q_proj, no MLA gate, g_a/g_b, softplus gate, plain residual, SiLU."""
        d = dict(_TINY_K3)
        lac = dict(d["linear_attn_config"])
        del lac["gate_lower_bound"], lac["use_full_rank_gate"]
        d.update(linear_attn_config=lac, q_lora_rank=None, mla_use_output_gate=False, attn_res_block_size=None,
                 routed_expert_hidden_size=None, latent_moe_use_norm=False, hidden_act="silu",
                 routed_scaling_factor=2.446)
        d.update(overrides)
        return cls.from_pretrained(d)

    @classmethod
    def k3(cls) -> "KimiK3Config":
        """Real-size Kimi-K3 text config (docs/SPEC.md §1.1)."""
        full = [i for i in range(4, 93, 4)] + [93]
        return cls.from_pretrained({"text_config": dict(
            model_type="kimi_linear", vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
            rms_norm_eps=1e-5, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True,
            mla_use_output_gate=True,
            linear_attn_config=dict(full_attn_layers=full,
                                    kda_layers=[i for i in range(1, 94) if i not in full],
                                    num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                    gate_lower_bound=-5.0, use_full_rank_gate=True),
            attn_res_block_size=12, first_k_dense_replace=1, moe_layer_freq=1, intermediate_size=33792,
            num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
            routed_expert_hidden_size=3584, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
            use_grouped_topk=True, num_expert_group=1, topk_group=1, moe_renormalize=True,
            routed_scaling_factor=1.0, hidden_act="situ", activation_situ_beta=4.0,
            activation_situ_linear_beta=25.0, tie_word_embeddings=False,
            bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, max_position_embeddings=1048576)})

    def to_hf_dict(self) -> dict[str, Any]:
        """A flat HF-style dict (Kimi-Linear key names) that `from_pretrained` reads back to this config."""
        lac = dict(
            full_attn_layers=[i + 1 for i in self.mla_layers], kda_layers=[i + 1 for i in self.kda_layers],
            num_heads=self.kda_num_heads, head_dim=self.kda_head_dim,
            short_conv_kernel_size=self.short_conv_kernel_size, use_full_rank_gate=self.use_full_rank_gate)
        if self.gate_lower_bound is not None:
            lac["gate_lower_bound"] = self.gate_lower_bound
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("layer_attn", "layer_ffn", "kda_num_heads", "kda_head_dim",
                               "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate",
                               "experts_format")}
        if d["max_position_embeddings"] is None:  # unknown: leave the key out, as configs without it do
            del d["max_position_embeddings"]
        d.update(model_type="kimi_linear", linear_attn_config=lac,
                 mlp_layer_types=["sparse" if f == "moe" else "dense" for f in self.layer_ffn])
        return d


def _positive_int(name: str, value: Any) -> int:
    """`value` as an int >= 1; any integer type (int, numpy integers), never bool or float."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: must be a positive int, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return v


def _optional_int(value: Any) -> int | None:
    """A config's integer field: None stays None; 1048576 and 1048576.0 are 1048576."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # anything else is reported by __post_init__, naming the field


_TINY_K3: dict[str, Any] = dict(
    model_type="kimi_linear", vocab_size=1000, hidden_size=256, rms_norm_eps=1e-5, num_hidden_layers=8,
    linear_attn_config=dict(full_attn_layers=[4, 7, 8], kda_layers=[1, 2, 3, 5, 6], num_heads=8, head_dim=32,
                            short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True),
    attn_res_block_size=3, num_attention_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True,
    first_k_dense_replace=1, intermediate_size=512, moe_layer_freq=1, num_experts=16, num_experts_per_token=4,
    num_shared_experts=2, moe_intermediate_size=64, routed_expert_hidden_size=128, latent_moe_use_norm=True,
    moe_router_activation_func="sigmoid", use_grouped_topk=True, num_expert_group=1, topk_group=1,
    moe_renormalize=True, routed_scaling_factor=1.0, hidden_act="situ", activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0, tie_word_embeddings=False)
