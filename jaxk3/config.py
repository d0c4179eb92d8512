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

import numpy as np

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
    # -- token ids.  eos_token_ids: every id that ends a row (HF's eos_token_id may be one id or a
    # list; generation stops at any of them); `eos_token_id` (a property) is the first, or None.
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # -- context length: prompt + generated tokens a model supports (HF `max_position_embeddings`;
    # K3 and Kimi-Linear-48B: 1048576, docs/SPEC.md §1.1).  None: unknown (not checked).
    max_position_embeddings: int | None = None
    # -- how the routed experts are held on the device (not a hub field; chosen at load):
    # "dense" (the model dtype) or "mxfp4" (packed E2M1 nibbles + E8M0 scales, as K3 ships them;
    # jaxk3.layers.moe.MXFP4).  load_model picks "mxfp4" where the checkpoint has it.
    experts_format: str = "dense"
    # -- a property of the loaded MXFP4 experts (not a hub field; set at load, `checkpoint.mark_experts_f16`): every
    # E8M0 scale lies in jaxk3.kernels.moe_experts.F16_SCALES, so each weight is a float16 exactly and the decode
    # kernels may run them on float16 tensor cores.  Declared on each MXFP4 stack (`MXFP4.f16`).
    experts_f16: bool = False

    # ------------------------------------------------------------------ derived
    @property
    def eos_token_id(self) -> int | None:
        """The first of `eos_token_ids` (None without any): what a reader of HF's field expects."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

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
        """Every field the model reads is checked here, by type, range and consistency, each error a
        `ConfigError` naming the field (from_pretrained renames it to the config.json key it came
        from).  Integers must be integers: a bool or a float (256.5, and 256.0 too) is refused, never
        truncated; numpy integers and floats are stored as Python ones (hash, equality, JSON)."""
        self._check_types()
        self._check_ranges()
        self._check_consistency()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            self._set(name, _int_value(name, getattr(self, name)))
        for name in _OPTIONAL_INT_FIELDS:
            if getattr(self, name) is not None:
                self._set(name, _int_value(name, getattr(self, name)))
        for name in _FLOAT_FIELDS:
            self._set(name, _float_value(name, getattr(self, name)))
        if self.gate_lower_bound is not None:
            self._set("gate_lower_bound", _float_value("gate_lower_bound", self.gate_lower_bound))
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ConfigError(name, f"must be true or false, got {_show(v)}")
            self._set(name, bool(v))
        for name in ("hidden_act", "moe_router_activation_func", "experts_format"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, f"must be a string, got {_show(getattr(self, name))}")
        for name in ("layer_attn", "layer_ffn"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
                raise ConfigError(name, f"must be a sequence of layer kinds, got {_show(v)}")
            self._set(name, tuple(v))
        eos = self.eos_token_ids
        if eos is None:
            eos = ()
        elif not isinstance(eos, (list, tuple)):
            eos = (eos,)
        self._set("eos_token_ids", tuple(_int_value("eos_token_id", t) for t in eos))
        mpe = self.max_position_embeddings
        if isinstance(mpe, float) and mpe.is_integer():  # 1048576.0, as some exporters write it
            mpe = int(mpe)
        if mpe is not None:
            try:
                mpe = _positive_int("max_position_embeddings", mpe)
            except ValueError:
                raise ConfigError("max_position_embeddings",
                                  f"must be a positive int or null, got {_show(self.max_position_embeddings)}") from None
        self._set("max_position_embeddings", mpe)

    def _check_ranges(self) -> None:
        moe, mlp = "moe" in self.layer_ffn, "mlp" in self.layer_ffn
        kda, mla = "kda" in self.layer_attn, "mla" in self.layer_attn
        at_least = {  # field: the smallest value the model can run (0: unused, e.g. no MoE layer)
            "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_shared_experts": 0,
            "num_attention_heads": int(mla), "kv_lora_rank": int(mla), "qk_nope_head_dim": int(mla),
            "qk_rope_head_dim": int(mla), "v_head_dim": int(mla),
            "kda_num_heads": int(kda), "kda_head_dim": int(kda), "short_conv_kernel_size": 1,
            "intermediate_size": int(mlp), "num_experts": int(moe), "num_experts_per_token": int(moe),
            "moe_intermediate_size": int(moe), "num_expert_group": 1, "topk_group": 1,
        }
        for name, lo in at_least.items():
            v = getattr(self, name)
            if v < lo:
                why = {0: ">= 0", 1: ">= 1"}[lo]
                raise ConfigError(name, f"must be {why}, got {v}")
        for name in ("attn_res_block_size", "q_lora_rank", "routed_expert_hidden_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(name, f"must be >= 1 or null, got {v}")
        for name in ("rms_norm_eps", "routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(name, f"must be a finite number > 0, got {v}")
        if self.gate_lower_bound is not None and not (math.isfinite(self.gate_lower_bound)
                                                     and self.gate_lower_bound < 0):
            raise ConfigError("gate_lower_bound", f"the lower bound of KDA's log decay must be a finite number < 0, "
                              f"got {self.gate_lower_bound}")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ConfigError(name, f"{v} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError("eos_token_id", f"{bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def _check_consistency(self) -> None:
        L = self.num_hidden_layers
        if len(self.layer_attn) != L or len(self.layer_ffn) != L:
            raise ConfigError("layer_attn/layer_ffn", f"need {L} entries (num_hidden_layers), got "
                              f"{len(self.layer_attn)}/{len(self.layer_ffn)}")
        if any(a not in ("kda", "mla") for a in self.layer_attn):
            raise ConfigError("layer_attn", f"entries must be 'kda' or 'mla', got {self.layer_attn}")
        if any(f not in ("mlp", "moe") for f in self.layer_ffn):
            raise ConfigError("layer_ffn", f"entries must be 'mlp' or 'moe', got {self.layer_ffn}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError("hidden_act", f"unknown activation {self.hidden_act!r}; known: {_ACTIVATIONS}")
        if self.moe_router_activation_func != "sigmoid":
            raise ConfigError("moe_router_activation_func",
                              f"only 'sigmoid' is implemented, got {self.moe_router_activation_func!r}")
        if self.experts_format not in EXPERTS_FORMATS:
            raise ConfigError("experts_format", f"must be one of {EXPERTS_FORMATS}, got {self.experts_format!r}")
        if "mla" in self.layer_attn and not self.mla_use_nope:
            raise ConfigError("mla_use_nope", "only NoPE MLA is implemented (Kimi-K3/Kimi-Linear); got false")
        if "moe" in self.layer_ffn:
            E, k = self.num_experts, self.num_experts_per_token
            G, g = self.num_expert_group, self.topk_group
            if k > E:
                raise ConfigError("num_experts_per_token", f"{k} > num_experts {E}: top-k picks among the experts")
            if E % G:
                raise ConfigError("num_expert_group", f"{G} groups do not divide num_experts {E}")
            if g > G:
                raise ConfigError("topk_group", f"{g} > num_expert_group {G}")
            if self.use_grouped_topk and G > 1:
                if E // G < 2:  # the group score is the sum of a group's best two experts
                    raise ConfigError("num_expert_group", f"{G} groups of num_experts {E} leave {E // G} expert "
                                      "per group; group-limited top-k (use_grouped_topk) scores a group by its best 2")
                if g * (E // G) < k:
                    raise ConfigError("topk_group", f"{g} groups of {E // G} experts hold fewer than "
                                      f"num_experts_per_token {k}")
            if self.experts_format == "mxfp4":
                for name, cols in (("routed expert input width (moe_hidden)", self.moe_hidden),
                                   ("moe_intermediate_size", self.moe_intermediate_size)):
                    if cols % MXFP4_GROUP:
                        raise ConfigError("experts_format", f"'mxfp4': {name} = {cols} is not a multiple of the "
                                          f"MXFP4 group {MXFP4_GROUP}")

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

    def cache_bytes_per_rank(self, batch: int, max_len: int, tp: int, dtype_bytes: int, ring: bool = False) -> int:
        """Bytes of the decode cache one TP rank holds for `batch` rows (the rows of this rank's
        data-parallel shard) of up to `max_len` positions, activations of `dtype_bytes` bytes:

          MLA latent cache  num_mla_layers x batch x max_len x (kv_lora_rank + qk_rope_head_dim)
                            x dtype_bytes, replicated on every TP rank
          KDA state         num_kda_layers x batch x (kda_num_heads / tp) x kda_head_dim^2 x 4 (fp32)
          KDA conv window   num_kda_layers x batch x 3 x (kda_dim / tp) x (short_conv_kernel_size - 1)
                            x dtype_bytes (`ring`: short_conv_kernel_size slots, jaxk3.kernels.kda_decode.RING)
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
        slots = self.short_conv_kernel_size - (not ring)
        conv = n_kda * batch * 3 * heads * self.kda_head_dim * slots * dtype_bytes
        return mla + state + conv + batch * 4

    # -------------------------------------------------------------- constructors
    @classmethod
    def from_pretrained(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "KimiK3Config":
        """From a HF model dir / config.json path / dict.  K3's nested `text_config` is unwrapped.

        Every problem is a ValueError naming the file (when read from one) and the field, e.g.
        `/ckpt/config.json: hidden_size: must be an integer, got 256.5 (not rounded)`."""
        if isinstance(path_or_dict, Mapping):
            raw, where = dict(path_or_dict), None
        else:
            where = os.fspath(path_or_dict)
            if os.path.isdir(where):
                where = os.path.join(where, "config.json")
            try:
                with open(where) as f:
                    raw = json.load(f)
            except OSError as e:
                raise ValueError(f"{where}: cannot read the config ({e.strerror or e})") from None
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{where}: not valid JSON ({e})") from None
        try:
            return cls._from_raw(raw)
        except ValueError as e:
            if where is None:
                raise
            raise type(e)(*_with_file(e, where)) from None

    @classmethod
    def _from_raw(cls, raw: Any) -> "KimiK3Config":
        if not isinstance(raw, Mapping):
            raise ValueError(f"config: must be a JSON object, got {json_type(raw)}")
        if "text_config" in raw and raw["text_config"] is not None:
            if not isinstance(raw["text_config"], Mapping):
                raise ConfigError("text_config", f"must be a JSON object, got {json_type(raw['text_config'])}")
            raw = dict(raw["text_config"])
        try:
            return cls._from_flat(raw)
        except (TypeError, AttributeError) as e:  # a field of the wrong JSON type: still a config error
            raise ValueError(f"config: a field has the wrong type ({e})") from None

    @classmethod
    def _from_flat(cls, c: Mapping[str, Any]) -> "KimiK3Config":
        lac = c.get("linear_attn_config")
        if lac is not None and not isinstance(lac, Mapping):
            raise ConfigError("linear_attn_config", f"must be a JSON object, got {json_type(lac)}")
        lac = dict(lac or {})
        keys: dict[str, str] = {}  # dataclass field -> the config key its value was read from
        LAC, TOP = (lac, "linear_attn_config."), (c, "")

        def get(field, *names, default=None, src=(LAC, TOP)):
            for d, prefix in src:
                for n in names:
                    if n in d and d[n] is not None:
                        keys[field] = prefix + n
                        return d[n]
            return default

        def need(field, *names):
            v = get(field, *(names or (field,)))
            if v is None:
                raise ConfigError((names or (field,))[0], "missing from the config")
            return v

        def count(name, value, lo):
            v = _int_value(name, value)
            if v < lo:
                raise ConfigError(name, f"must be >= {lo}, got {v}")
            return v

        L = count("num_hidden_layers", need("num_hidden_layers"), 1)
        # attention schedule: linear_attn_config (1-based) > layer_types > every 4th MLA
        full, kda = lac.get("full_attn_layers"), lac.get("kda_layers")
        if full is not None or kda is not None:
            full, kda = _layer_ids("full_attn_layers", full), _layer_ids("kda_layers", kda)
            bad = [i for i in full + kda if not 1 <= i <= L]
            if bad:
                raise ConfigError("linear_attn_config.full_attn_layers/kda_layers",
                                  f"1-based ids out of 1..{L}: {bad}")
            if set(full) & set(kda):
                raise ConfigError("linear_attn_config",
                                  f"layers in both full_attn_layers and kda_layers: {sorted(set(full) & set(kda))}")
            if len(set(full)) + len(set(kda)) != L:
                missing = sorted(set(range(1, L + 1)) - set(full) - set(kda))
                raise ConfigError("linear_attn_config.full_attn_layers/kda_layers",
                                  f"must cover layers 1..{L} once; missing {missing}")
            layer_attn = tuple("mla" if (i + 1) in set(full) else "kda" for i in range(L))
        elif c.get("layer_types") is not None:
            lt = c["layer_types"]
            if not isinstance(lt, (list, tuple)) or len(lt) != L or any(
                    t not in ("full_attention", "linear_attention") for t in lt):
                raise ConfigError("layer_types", f"need {L} of 'full_attention'/'linear_attention', got {_show(lt)}")
            layer_attn = tuple("mla" if t == "full_attention" else "kda" for t in lt)
        else:
            layer_attn = tuple("mla" if i and i % 4 == 0 else "kda" for i in range(L))

        fkd = count("first_k_dense_replace", get("fkd", "first_k_dense_replace", default=1), 0)
        freq = count("moe_layer_freq", get("freq", "moe_layer_freq", default=1), 1)
        if c.get("mlp_layer_types") is not None:
            mt = c["mlp_layer_types"]
            if not isinstance(mt, (list, tuple)) or len(mt) != L or any(t not in ("dense", "sparse") for t in mt):
                raise ConfigError("mlp_layer_types", f"need {L} of 'dense'/'sparse', got {_show(mt)}")
            layer_ffn = tuple("moe" if t == "sparse" else "mlp" for t in mt)
        else:
            layer_ffn = tuple("moe" if (i >= fkd and i % freq == 0) else "mlp" for i in range(L))

        eos = c.get("eos_token_id")  # one id or a list of them (generation stops at any)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        top = (TOP,)
        kw = dict(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=L,
            rms_norm_eps=get("rms_norm_eps", "rms_norm_eps", default=1e-5),
            layer_attn=layer_attn,
            layer_ffn=layer_ffn,
            attn_res_block_size=get("attn_res_block_size", "attn_res_block_size"),
            tie_word_embeddings=get("tie_word_embeddings", "tie_word_embeddings", default=False, src=top),
            num_attention_heads=need("num_attention_heads"),
            q_lora_rank=get("q_lora_rank", "q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank", "kv_lora_rank", default=512),
            qk_nope_head_dim=get("qk_nope_head_dim", "qk_nope_head_dim", default=128),
            qk_rope_head_dim=get("qk_rope_head_dim", "qk_rope_head_dim", default=64),
            v_head_dim=get("v_head_dim", "v_head_dim", default=128),
            mla_use_nope=get("mla_use_nope", "mla_use_nope", default=True),
            mla_use_output_gate=get("mla_use_output_gate", "mla_use_output_gate", default=False),
            kda_num_heads=_first(get("kda_num_heads", "num_heads", "linear_num_heads", src=(LAC,)),
                                 get("kda_num_heads", "linear_num_heads", src=top), 32),
            kda_head_dim=_first(get("kda_head_dim", "head_dim", src=(LAC,)),
                                get("kda_head_dim", "linear_head_dim", src=top), 128),
            short_conv_kernel_size=_first(get("short_conv_kernel_size", "short_conv_kernel_size", src=(LAC,)),
                                          get("short_conv_kernel_size", "linear_conv_kernel_dim", src=top), 4),
            gate_lower_bound=get("gate_lower_bound", "gate_lower_bound"),
            use_full_rank_gate=get("use_full_rank_gate", "use_full_rank_gate", default=False),
            intermediate_size=need("intermediate_size"),
            num_experts=get("num_experts", "num_experts", "num_local_experts", "n_routed_experts", default=0),
            num_experts_per_token=get("num_experts_per_token", "num_experts_per_token", "num_experts_per_tok",
                                      default=1),
            num_shared_experts=get("num_shared_experts", "num_shared_experts", "n_shared_experts", default=0),
            moe_intermediate_size=get("moe_intermediate_size", "moe_intermediate_size", default=0),
            routed_expert_hidden_size=get("routed_expert_hidden_size", "routed_expert_hidden_size"),
            latent_moe_use_norm=get("latent_moe_use_norm", "latent_moe_use_norm",
                                    default=get("_", "routed_expert_hidden_size") is not None),
            moe_router_activation_func=get("moe_router_activation_func", "moe_router_activation_func",
                                           default="sigmoid"),
            use_grouped_topk=get("use_grouped_topk", "use_grouped_topk", default=True),
            num_expert_group=get("num_expert_group", "num_expert_group", "n_group", default=1),
            topk_group=get("topk_group", "topk_group", default=1),
            moe_renormalize=get("moe_renormalize", "moe_renormalize", "norm_topk_prob", default=True),
            routed_scaling_factor=get("routed_scaling_factor", "routed_scaling_factor", default=1.0),
            hidden_act=get("hidden_act", "hidden_act", default="silu", src=top),
            activation_situ_beta=get("activation_situ_beta", "activation_situ_beta", default=4.0),
            activation_situ_linear_beta=get("activation_situ_linear_beta", "activation_situ_linear_beta",
                                            default=25.0),
            bos_token_id=get("bos_token_id", "bos_token_id", src=top),
            eos_token_ids=eos,
            pad_token_id=get("pad_token_id", "pad_token_id", src=top),
            # transformers' KimiLinearConfig stores it as `model_max_length` (its attribute_map)
            max_position_embeddings=get("max_position_embeddings", "max_position_embeddings", "model_max_length"),
        )
        try:
            return cls(**kw)
        except ConfigError as e:  # name the key the user wrote (linear_attn_config.num_heads, n_group, ...)
            name = keys.get(e.field)
            if name is None or name == e.field:
                raise
            raise ConfigError(name, e.detail) from None

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
                               "experts_format", "experts_f16")}
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = None if not eos else eos[0] if len(eos) == 1 else list(eos)
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


class ConfigError(ValueError):
    """A config field of the wrong type, out of range, or inconsistent with another: `field: detail`."""

    def __init__(self, field: str, detail: str):
        self.field, self.detail = field, detail
        super().__init__(f"{field}: {detail}")


def _with_file(e: ValueError, where: str) -> tuple:
    """The arguments of `e` again, its message prefixed with the file it is about."""
    if isinstance(e, ConfigError):
        return (f"{where}: {e.field}", e.detail)
    return (f"{where}: {str(e).removeprefix('config: ')}",)


def json_type(v: Any) -> str:
    """What JSON calls the type of `v`: an object, an array, a string, ..."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a bool", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _show(v: Any) -> str:
    """`v` as config.json spells it (true, 256.5, "3", [1, 2]), cut to 80 characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_value(name: str, v: Any) -> int:
    """`v` as an int: int or numpy integer; a bool, a float (even 256.0) or a string is a ConfigError."""
    if isinstance(v, (bool, np.bool_)):
        raise ConfigError(name, f"must be an integer, got {_show(v)} (a bool)")
    if isinstance(v, (float, np.floating)):
        hint = f"write {int(v)}" if math.isfinite(v) and float(v).is_integer() else "not rounded"
        raise ConfigError(name, f"must be an integer, got {_show(float(v))} ({hint})")
    try:
        return operator.index(v)
    except TypeError:
        raise ConfigError(name, f"must be an integer, got {_show(v)}") from None


def _float_value(name: str, v: Any) -> float:
    """`v` as a float: any int or float (numpy ones too), never a bool or a string."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ConfigError(name, f"must be a number, got {_show(v)}")
    return float(v)


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    return next(v for v in values if v is not None)


def _layer_ids(name: str, v: Any) -> list[int]:
    """linear_attn_config.<name>: a list of 1-based layer ids (ints)."""
    if v is None:
        return []
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"linear_attn_config.{name}", f"must be a list of 1-based layer ids, got {_show(v)}")
    return [_int_value(f"linear_attn_config.{name}", i) for i in v]


# The fields __post_init__ checks by type (the rest: the layer lists, strings, eos, max_position_embeddings).
_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
               "short_conv_kernel_size", "intermediate_size", "num_experts", "num_experts_per_token",
               "num_shared_experts", "moe_intermediate_size", "num_expert_group", "topk_group")
_OPTIONAL_INT_FIELDS = ("attn_res_block_size", "q_lora_rank", "routed_expert_hidden_size", "bos_token_id",
                        "pad_token_id")
_FLOAT_FIELDS = ("rms_norm_eps", "routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta")
_BOOL_FIELDS = ("tie_word_embeddings", "mla_use_nope", "mla_use_output_gate", "use_full_rank_gate",
                "latent_moe_use_norm", "use_grouped_topk", "moe_renormalize")


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
