"""jaxk3 against third-party oracles: fla-core's naive KDA / AttnRes, and transformers'
`KimiLinearForCausalLM` end to end (greedy, float32).

Tolerances (all float32 on both sides; max|Δ| relative to max|reference|):
- fla KDA, 64 steps: 1e-5.  fla's naive recurrence is the same math as ours step by step; its
  chunked form reorders the sums within a 64-token chunk (a triangular solve).  Observed
  <= 9e-7 for outputs and states against both forms (float32 unit roundoff 6e-8 times the
  depth of the 64-step chain); 1e-5 is a 10x margin and fails on any gate / scale / layout
  mistake (those give O(1e-2..1) differences).
- fla AttnRes: 1e-5 (one softmax and two RMSNorms over 256-wide vectors; observed 1.3e-7).
- transformers Kimi-Linear, 8 prompt tokens + 6 new: tokens equal and logits within 1e-4.
  transformers runs the prompt through its *chunked* KDA and full-sequence conv, then recurrent
  steps with a DynamicCache; we run everything token by token.  Both are float32, with
  different association orders over 8 layers of hidden 256; observed 3e-7 (TP 1 and TP 4), so
  1e-4 is a >300x margin, still far below the >=1e-2 that one wrong block (e.g. a dropped gate)
  gives.
"""
from __future__ import annotations

import dataclasses


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxk3
from jaxk3.config import KimiK3Config
from jaxk3.kernels.attn_res_norm import attn_res
from jaxk3.layers.kda import kda_prefill, kda_step
from jaxk3.kernels.rms_norm import rms_norm
from jaxk3.checkpoint import weights_from_hf
from jaxk3.model import random_hf_weights

torch = pytest.importorskip("torch", reason="torch is not installed (oracle tests run on the Python 3.11 leg)")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


@pytest.fixture(scope="module")
def fla():
    pytest.importorskip("einops", reason="einops is needed by fla's naive files")
    from refs.fla_loader import load_fla_file
    try:
        return load_fla_file("ops/kda/naive.py"), load_fla_file("ops/attnres/naive.py")
    except ImportError as e:
        pytest.skip(f"fla-core is not installed: {e}")


# ------------------------------------------------------------------------------ fla KDA
def _torch_kda_inputs(cfg, W, p, xs):
    """q, k, v, g, beta for fla from the checkpoint weights, in torch (conv over the whole sequence)."""
    t = lambda n: torch.tensor(np.asarray(W[p + n]), dtype=torch.float32)
    x = torch.tensor(xs)  # [T, D]
    T, H, d = xs.shape[0], cfg.kda_num_heads, cfg.kda_head_dim
    outs = []
    for n in "qkv":
        u = x @ t(f"{n}_proj.weight").T  # [T, C]
        w = t(f"{n}_conv1d.weight")  # [C, 1, K]
        y = torch.nn.functional.conv1d(u.T[None], w, padding=w.shape[-1] - 1, groups=w.shape[0])[0, :, :T].T
        outs.append(torch.nn.functional.silu(y).reshape(T, H, d))
    q, k, v = outs
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = (x @ t("f_a_proj.weight").T) @ t("f_b_proj.weight").T  # [T, C]
    A = t("A_log").reshape(-1)[:H]
    # fla/ops/kda/gate.py formulas (that file imports triton, so they are restated here)
    f = f.reshape(T, H, d) + t("dt_bias").reshape(H, d)
    if cfg.gate_lower_bound is not None:
        g = cfg.gate_lower_bound * torch.sigmoid(A.exp()[:, None] * f)
    else:
        g = -A.exp()[:, None] * torch.nn.functional.softplus(f)
    beta = torch.sigmoid(x @ t("b_proj.weight").T)
    return [a[None] for a in (q, k, v, g, beta)]


@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_kda_vs_fla_naive(mode, fla):
    kda_naive, _ = fla
    cfg = KimiK3Config.tiny_k3() if mode == "k3" else KimiK3Config.tiny_kimi_linear()
    W = random_hf_weights(cfg, 3)
    l = cfg.kda_layers[0]
    p = f"model.layers.{l}.self_attn."
    w = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), weights_from_hf(cfg, W).layers[l].attn)
    T, C, K, H, d = 64, cfg.kda_dim, cfg.short_conv_kernel_size, cfg.kda_num_heads, cfg.kda_head_dim
    xs = np.random.default_rng(9).standard_normal((T, cfg.hidden_size)).astype(np.float32)
    # jaxk3: 64 one-token steps; collect the pre-o_proj core outputs via the state
    conv, state = jnp.zeros((1, 3, C, K - 1)), jnp.zeros((1, H, d, d))
    step = jax.jit(lambda w, x, c, s: kda_step(cfg, w, x, c, s, jnp.ones(1, bool), None))
    ours = []
    for t in range(T):
        out, conv, state = step(w, xs[t:t + 1], conv, state)
        ours.append(np.asarray(out[0]))
    q, k, v, g, beta = _torch_kda_inputs(cfg, W, p, xs)
    with torch.no_grad():
        o_rec, S_rec = kda_naive.naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
        o_chk, S_chk = kda_naive.naive_chunk_kda(q, k, v, g, beta, output_final_state=True)
        tw = lambda n: torch.tensor(np.asarray(W[p + n]), dtype=torch.float32)
        x = torch.tensor(xs)
        z = (x @ tw("g_proj.weight").T if cfg.use_full_rank_gate
             else (x @ tw("g_a_proj.weight").T) @ tw("g_b_proj.weight").T).reshape(T, H, d)
        outs = []
        for o in (o_rec[0], o_chk[0]):
            o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + cfg.rms_norm_eps) * tw("o_norm.weight")
            outs.append(((o * torch.sigmoid(z)).reshape(T, C) @ tw("o_proj.weight").T).numpy())
    assert rel_err(S_rec[0].numpy(), S_chk[0].numpy()) <= 1e-5  # the two fla forms agree
    # jaxk3's prefill: the same 64 tokens at once (chunked form: one chunk of 64)
    pre, _, S_pre = jax.jit(lambda w, x: kda_prefill(cfg, w, x, jnp.zeros((1, 3, C, K - 1)), jnp.zeros((1, H, d, d)),
                                                     jnp.ones((1, T), bool), None, chunk=64))(w, xs[None])
    for ref, S in zip(outs, (S_rec, S_chk)):
        assert rel_err(np.stack(ours), ref) <= 1e-5
        assert rel_err(np.asarray(state[0]), S[0].numpy()) <= 1e-5
        assert rel_err(np.asarray(pre[0]), ref) <= 1e-5
        assert rel_err(np.asarray(S_pre[0]), S[0].numpy()) <= 1e-5


# --------------------------------------------------------------------------- fla AttnRes
@pytest.mark.parametrize("n", [1, 3])
def test_attn_res_vs_fla_naive(n, fla):
    _, ar = fla
    rng = np.random.default_rng(n)
    D = 256
    srcs = [(rng.standard_normal((2, D)) * (1 + i)).astype(np.float32) for i in range(n)]
    wq, wn, wo = (rng.standard_normal(D) * s + c for s, c in ((0.1, 0.0), (0.1, 1.0), (0.1, 1.0)))
    wq, wn, wo = (a.astype(np.float32) for a in (wq, wn, wo))
    ours = rms_norm(attn_res([jnp.asarray(s) for s in srcs], wn, wq[None], 1e-5), wo, 1e-5)
    with torch.no_grad():
        ref = ar.naive_attnres(torch.tensor(wq), [torch.tensor(s) for s in srcs], torch.tensor(wn),
                               output_rms_weight=torch.tensor(wo), rms_eps=1e-5)
    assert rel_err(ours, ref.numpy()) <= 1e-5


# ------------------------------------------------------------------ transformers end to end
def _hf_state_to_checkpoint(sd: dict, cfg: KimiK3Config) -> dict[str, np.ndarray]:
    """Undo transformers' Kimi-Linear conversion_mapping: back to the checkpoint's tensor names."""
    out = {}
    C = cfg.kda_dim
    for name, t in sd.items():
        a = t.detach().float().numpy()
        if ".forget_gate." in name:
            out[name.replace(".forget_gate.", ".")] = a
        elif name.endswith("self_attn.conv1d.weight"):
            for i, n in enumerate("qkv"):
                out[name.replace("conv1d", f"{n}_conv1d")] = a[i * C:(i + 1) * C]
        elif ".mlp." in name and cfg.layer_ffn[int(name.split(".")[2])] == "moe":
            m = name.replace(".mlp.", ".block_sparse_moe.")
            if m.endswith("experts.gate_up_proj"):
                I = a.shape[1] // 2
                for e in range(a.shape[0]):
                    out[m.replace("gate_up_proj", f"{e}.w1.weight")] = a[e, :I]
                    out[m.replace("gate_up_proj", f"{e}.w3.weight")] = a[e, I:]
            elif m.endswith("experts.down_proj"):
                for e in range(a.shape[0]):
                    out[m.replace("down_proj", f"{e}.w2.weight")] = a[e]
            else:
                out[m] = a
        else:
            out[name] = a
    return out


@pytest.fixture(scope="module")
def transformers_run():
    """A random tiny KimiLinearForCausalLM (fp32) and its greedy run: (cfg, model, prompt, tokens, logits)."""
    tf = pytest.importorskip("transformers", reason="transformers==5.23.0 is not installed")
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    cfg = KimiK3Config.tiny_kimi_linear()
    hcfg = tf.KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.num_shared_experts, routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=1, topk_group=1,
        num_experts_per_tok=cfg.num_experts_per_token, num_local_experts=cfg.num_experts, norm_topk_prob=True,
        hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=False, linear_head_dim=cfg.kda_head_dim, linear_num_heads=cfg.kda_num_heads,
        linear_conv_kernel_dim=cfg.short_conv_kernel_size,
        layer_types=["full_attention" if a == "mla" else "linear_attention" for a in cfg.layer_attn],
        mlp_layer_types=["sparse" if f == "moe" else "dense" for f in cfg.layer_ffn])
    hcfg._attn_implementation = "eager"
    parsed = KimiK3Config.from_pretrained(hcfg.to_dict())  # the transformers spelling parses to the same
    assert dataclasses.replace(parsed, max_position_embeddings=cfg.max_position_embeddings) == cfg
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(hcfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # make the norms, router bias and gates non-trivial
        for name, prm in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("norm.weight"):
                prm.copy_(1 + 0.1 * torch.randn(prm.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                prm.copy_(0.1 * torch.randn(prm.shape, generator=gen))
            elif name.endswith("conv1d.weight"):
                prm.copy_(0.3 * torch.randn(prm.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                prm.copy_(torch.randn(prm.shape, generator=gen))
        for mod in hf.modules():  # vLLM's kv_a_layernorm uses rms_norm_eps; transformers' defaults to 1e-6
            if type(mod).__name__ == "KimiLinearAttention":
                mod.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    prompt, new = [3, 14, 15, 92, 65, 35, 89, 79], 6
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
        past, logits = out.past_key_values, [out.logits[0, -1]]
        toks = [int(logits[-1].argmax())]
        for _ in range(new - 1):
            out = hf(input_ids=torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
            toks.append(int(logits[-1].argmax()))
    return cfg, hf, prompt, toks, torch.stack(logits).numpy()


def test_kimi_linear_vs_transformers(transformers_run):
    cfg, hf, prompt, toks, ref_logits = transformers_run
    new = len(toks)
    ckpt = _hf_state_to_checkpoint(hf.state_dict(), cfg)
    model = jaxk3.Model.from_weights(cfg, ckpt, tp=1, dtype="float32")
    res = model.generate([prompt], new, return_logits=True)
    np.testing.assert_array_equal(res.tokens[0], toks)
    assert rel_err(res.logits[0], ref_logits) <= 1e-4
    # and with TP 4 (float32): same tokens, same logits up to float32 reassociation
    res4 = jaxk3.Model.from_weights(cfg, ckpt, tp=4, dtype="float32", gather="lax").generate([prompt], new,
                                                                                             return_logits=True)
    np.testing.assert_array_equal(res4.tokens[0], toks)
    assert rel_err(res4.logits[0], ref_logits) <= 1e-4


def test_transformers_save_pretrained_loads(transformers_run, tmp_path):
    """A checkpoint written by transformers' own `save_pretrained` (5.23 writes layer 0's dense MLP as
    `block_sparse_moe.{gate,up,down}_proj`, and its own config.json spelling) loads with
    `jaxk3.load_model` and decodes to the same tokens and logits as transformers (tolerance as above)."""
    cfg, hf, prompt, toks, ref_logits = transformers_run
    hf.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert "model.layers.0.block_sparse_moe.gate_proj.weight" in set(f.keys())  # the spelling under test
    model = jaxk3.load_model(str(tmp_path), tp=2, dtype="float32", gather="lax")
    res = model.generate([prompt], len(toks), return_logits=True)
    np.testing.assert_array_equal(res.tokens[0], toks)
    assert rel_err(res.logits[0], ref_logits) <= 1e-4


def test_transformers_full_sequence_logits_vs_score(transformers_run):
    """transformers' forward over a whole prompt (logits at every position) vs Model.score (prefill)."""
    cfg, hf, prompt, toks, _ = transformers_run
    seq = prompt + toks[:-1]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].numpy()
    model = jaxk3.Model.from_weights(cfg, _hf_state_to_checkpoint(hf.state_dict(), cfg), tp=2, dtype="float32")
    got = model.score([seq])[0]
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-4
