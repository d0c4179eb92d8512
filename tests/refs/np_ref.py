"""Float64 NumPy reference of Kimi-K3 / Kimi-Linear decode, written from the spec (§3) alone.

Independent of jaxk3's math: it reads the HF-style config dict and HF-named weights, loops over
heads / experts / cached positions in plain NumPy, uses the NON-absorbed MLA form (explicit
per-head keys and values from the latent cache), and keeps the KDA state in the fla [K, V] layout.
One sequence at a time (batch 1).
"""
from __future__ import annotations

import math

import numpy as np

f64 = np.float64


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rms_norm(x, w, eps):
    x = np.asarray(x, f64)
    return np.asarray(w, f64).reshape(-1) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x, w, z, eps):
    return rms_norm(x, w, eps) * sigmoid(np.asarray(z, f64))


def attn_res(sources, w_norm, w_proj, eps):
    """sources: list of [D] vectors.  softmax over sources of w_proj·RMSNorm(s), mix raw sources."""
    logits = np.array([float(np.dot(np.asarray(w_proj, f64).reshape(-1), rms_norm(s, w_norm, eps)))
                       for s in sources])
    a = np.exp(logits - logits.max())
    a /= a.sum()
    return sum(ai * np.asarray(s, f64) for ai, s in zip(a, sources))


def glu(a, b, act, beta=4.0, lbeta=25.0):
    a, b = np.asarray(a, f64), np.asarray(b, f64)
    if act == "silu":
        return silu(a) * b
    assert act == "situ"
    return beta * np.tanh(a / beta) * sigmoid(a) * lbeta * np.tanh(b / lbeta)


def mat(w):
    return np.asarray(w, f64)


class Config:
    """The fields of an HF-style (Kimi-Linear key names) config dict this reference needs."""

    def __init__(self, d: dict):
        if "text_config" in d:
            d = d["text_config"]
        lac = d["linear_attn_config"]
        self.L = d["num_hidden_layers"]
        full = set(lac["full_attn_layers"])  # 1-based
        self.is_mla = [(i + 1) in full for i in range(self.L)]
        fkd = d.get("first_k_dense_replace", 1)
        if d.get("mlp_layer_types"):
            self.is_moe = [t == "sparse" for t in d["mlp_layer_types"]]
        else:
            freq = d.get("moe_layer_freq", 1)
            self.is_moe = [i >= fkd and i % freq == 0 for i in range(self.L)]
        self.eps = d.get("rms_norm_eps", 1e-5)
        self.V = d["vocab_size"]
        self.H_kda, self.d_kda = lac["num_heads"], lac["head_dim"]
        self.K_conv = lac["short_conv_kernel_size"]
        self.lb = lac.get("gate_lower_bound", d.get("gate_lower_bound"))
        self.full_rank_gate = lac.get("use_full_rank_gate", d.get("use_full_rank_gate", False))
        self.Hm = d["num_attention_heads"]
        self.q_lora = d.get("q_lora_rank")
        self.R = d["kv_lora_rank"]
        self.n, self.r, self.v = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        self.mla_gate = d.get("mla_use_output_gate", False)
        self.block = d.get("attn_res_block_size")
        self.latent = d.get("routed_expert_hidden_size")
        self.latent_norm = d.get("latent_moe_use_norm", self.latent is not None)
        self.E, self.topk = d["num_experts"], d["num_experts_per_token"]
        self.n_shared = d.get("num_shared_experts", 0)
        self.renorm = d.get("moe_renormalize", True)
        self.n_group = d.get("num_expert_group", 1) if d.get("use_grouped_topk", True) else 1
        self.topk_group = d.get("topk_group", 1)
        self.rsf = d.get("routed_scaling_factor", 1.0)
        self.act = d.get("hidden_act", "silu")
        self.b1 = d.get("activation_situ_beta", 4.0)
        self.b2 = d.get("activation_situ_linear_beta", 25.0)


class KDAState:
    def __init__(self, cfg: Config):
        C = cfg.H_kda * cfg.d_kda
        self.conv = np.zeros((3 * C, cfg.K_conv - 1))  # oldest -> newest
        self.S = np.zeros((cfg.H_kda, cfg.d_kda, cfg.d_kda))  # [H, K, V]


def kda_step(cfg: Config, W: dict, p: str, x, st: KDAState):
    """One token of KDA for layer prefix p (e.g. 'model.layers.0.self_attn.')."""
    H, d = cfg.H_kda, cfg.d_kda
    x = np.asarray(x, f64)
    u = np.concatenate([mat(W[p + "q_proj.weight"]) @ x, mat(W[p + "k_proj.weight"]) @ x,
                        mat(W[p + "v_proj.weight"]) @ x])
    wc = np.concatenate([mat(W[p + n + "_conv1d.weight"])[:, 0, :] for n in "qkv"])  # [3C, K]
    y = np.empty_like(u)
    for j in range(u.size):
        win = np.append(st.conv[j], u[j])
        y[j] = silu(np.dot(wc[j], win))
        st.conv[j] = win[1:]
    q, k, v = np.split(y, 3)
    f = mat(W[p + "f_b_proj.weight"]) @ (mat(W[p + "f_a_proj.weight"]) @ x) + mat(W[p + "dt_bias"])
    A = mat(W[p + "A_log"]).reshape(-1)[:H]
    beta = sigmoid(mat(W[p + "b_proj.weight"]) @ x)
    if cfg.full_rank_gate:
        z = mat(W[p + "g_proj.weight"]) @ x
    else:
        z = mat(W[p + "g_b_proj.weight"]) @ (mat(W[p + "g_a_proj.weight"]) @ x)
    outs = []
    for h in range(H):
        sl = slice(h * d, (h + 1) * d)
        qh = q[sl] / math.sqrt(np.sum(q[sl] ** 2) + 1e-6) / math.sqrt(d)
        kh = k[sl] / math.sqrt(np.sum(k[sl] ** 2) + 1e-6)
        fh = f[sl]
        if cfg.lb is not None:
            g = cfg.lb * sigmoid(math.exp(A[h]) * fh)
        else:
            g = -math.exp(A[h]) * np.where(fh > 20, fh, np.log1p(np.exp(np.minimum(fh, 20))))
        S = st.S[h] * np.exp(g)[:, None]
        S = S + np.outer(kh, beta[h] * (v[sl] - S.T @ kh))
        st.S[h] = S
        o = S.T @ qh
        outs.append(gated_rms_norm(o, W[p + "o_norm.weight"], z[sl], cfg.eps))
    return mat(W[p + "o_proj.weight"]) @ np.concatenate(outs)


def mla_step(cfg: Config, W: dict, p: str, x, cache: list):
    """One token of NoPE MLA, non-absorbed: expand every cached latent into per-head k and v."""
    H, n, r, v, R = cfg.Hm, cfg.n, cfg.r, cfg.v, cfg.R
    x = np.asarray(x, f64)
    if cfg.q_lora is not None:
        cq = rms_norm(mat(W[p + "q_a_proj.weight"]) @ x, W[p + "q_a_layernorm.weight"], cfg.eps)
        q = (mat(W[p + "q_b_proj.weight"]) @ cq).reshape(H, n + r)
    else:
        q = (mat(W[p + "q_proj.weight"]) @ x).reshape(H, n + r)
    ckv = mat(W[p + "kv_a_proj_with_mqa.weight"]) @ x
    cache.append(np.concatenate([rms_norm(ckv[:R], W[p + "kv_a_layernorm.weight"], cfg.eps), ckv[R:]]))
    wkvb = mat(W[p + "kv_b_proj.weight"]).reshape(H, n + v, R)
    o = np.zeros((H, v))
    for h in range(H):
        keys = np.stack([np.concatenate([wkvb[h, :n] @ c[:R], c[R:]]) for c in cache])  # [T, n+r]
        vals = np.stack([wkvb[h, n:] @ c[:R] for c in cache])  # [T, v]
        s = keys @ q[h] / math.sqrt(n + r)
        a = np.exp(s - s.max())
        o[h] = (a / a.sum()) @ vals
    o = o.reshape(-1)
    if cfg.mla_gate:
        o = o * sigmoid(mat(W[p + "g_proj.weight"]) @ x)
    return mat(W[p + "o_proj.weight"]) @ o


def dense_mlp(cfg: Config, W: dict, p: str, x):
    x = np.asarray(x, f64)
    h = glu(mat(W[p + "gate_proj.weight"]) @ x, mat(W[p + "up_proj.weight"]) @ x, cfg.act, cfg.b1, cfg.b2)
    return mat(W[p + "down_proj.weight"]) @ h


def route(cfg: Config, W: dict, m: str, x):
    """Returns (selected expert ids, their weights incl. routed_scaling_factor)."""
    s = sigmoid(mat(W[m + "gate.weight"]) @ np.asarray(x, f64))
    choice = s + mat(W[m + "gate.e_score_correction_bias"])
    if cfg.n_group > 1:  # keep the topk_group groups whose two best scores sum highest
        groups = choice.reshape(cfg.n_group, -1)
        gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-gscore, kind="stable")[: cfg.topk_group]
        choice = np.where(np.isin(np.arange(cfg.n_group), keep)[:, None], groups, -np.inf).reshape(-1)
    ids = list(np.argsort(-choice, kind="stable")[: cfg.topk])
    w = s[ids]
    if cfg.renorm:
        w = w / (w.sum() + 1e-20)
    return ids, w * cfg.rsf


def moe(cfg: Config, W: dict, m: str, x):
    x = np.asarray(x, f64)
    ids, w = route(cfg, W, m, x)
    z = mat(W[m + "routed_expert_down_proj.weight"]) @ x if cfg.latent else x
    y = 0.0
    for e, we in zip(ids, w):
        pe = f"{m}experts.{e}."
        h = glu(mat(W[pe + "w1.weight"]) @ z, mat(W[pe + "w3.weight"]) @ z, cfg.act, cfg.b1, cfg.b2)
        y = y + we * (mat(W[pe + "w2.weight"]) @ h)
    if cfg.latent:
        if cfg.latent_norm:
            y = rms_norm(y, W[m + "routed_expert_norm.weight"], cfg.eps)
        y = mat(W[m + "routed_expert_up_proj.weight"]) @ y
    if cfg.n_shared:
        y = y + dense_mlp(cfg, W, m + "shared_experts.", x)
    return y


class RefModel:
    """Decode one sequence token by token; `step(token) -> logits [V]` (float64)."""

    def __init__(self, cfg_dict: dict, W: dict):
        self.cfg = Config(cfg_dict)
        self.W = {k: np.asarray(v, f64) for k, v in W.items()}
        self.kda = {l: KDAState(self.cfg) for l in range(self.cfg.L) if not self.cfg.is_mla[l]}
        self.mla = {l: [] for l in range(self.cfg.L) if self.cfg.is_mla[l]}

    def _attn(self, l, x):
        p = f"model.layers.{l}.self_attn."
        if self.cfg.is_mla[l]:
            return mla_step(self.cfg, self.W, p, x, self.mla[l])
        return kda_step(self.cfg, self.W, p, x, self.kda[l])

    def _ffn(self, l, x):
        if self.cfg.is_moe[l]:
            return moe(self.cfg, self.W, f"model.layers.{l}.block_sparse_moe.", x)
        return dense_mlp(self.cfg, self.W, f"model.layers.{l}.mlp.", x)

    def step(self, token: int):
        c, W = self.cfg, self.W
        x = W["model.embed_tokens.weight"][token]
        P = lambda l, n: W[f"model.layers.{l}.{n}.weight"]
        if c.block is None:
            h = x
            for l in range(c.L):
                h = h + self._attn(l, rms_norm(h, P(l, "input_layernorm"), c.eps))
                h = h + self._ffn(l, rms_norm(h, P(l, "post_attention_layernorm"), c.eps))
        else:
            # AttnRes: a list of finished block snapshots plus the running partial sum
            blocks, partial = [], x
            for l in range(c.L):
                if l > 0:
                    partial = partial + mlp_out
                if l % c.block == 0:
                    blocks.append(partial)
                    visible = blocks[:-1]  # the block just written is the partial itself
                else:
                    visible = blocks
                h = attn_res(visible + [partial], P(l, "self_attention_res_norm"), P(l, "self_attention_res_proj"),
                             c.eps)
                a = self._attn(l, rms_norm(h, P(l, "input_layernorm"), c.eps))
                partial = a if l % c.block == 0 else partial + a
                h = attn_res(blocks + [partial], P(l, "mlp_res_norm"), P(l, "mlp_res_proj"), c.eps)
                mlp_out = self._ffn(l, rms_norm(h, P(l, "post_attention_layernorm"), c.eps))
            partial = partial + mlp_out
            h = attn_res(blocks + [partial], W["model.output_attn_res_norm.weight"],
                         W["model.output_attn_res_proj.weight"], c.eps)
        head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
        return head @ rms_norm(h, W["model.norm.weight"], c.eps)
