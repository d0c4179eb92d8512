"""The residual stream: block Attention Residuals (K3) or the plain pre-norm residual (Kimi-Linear).

AttnRes (docs/SPEC.md §3.1): a softmax over depth replaces `x + residual`:

    r_i     = rsqrt(mean(s_i²) + eps)
    logit_i = Σ_d s_i[d]·r_i·w_norm[d]·w_proj[d]        (= w_proj · RMSNorm(s_i; w_norm))
    α       = softmax_i(logit)                           over the N depth sources
    h       = Σ_i α_i s_i                                mixes the UN-normalised sources

All in fp32.  Nothing is cached across decode steps: AttnRes mixes over depth, not time.

The K3 schedule (block size Bs; `g` is a layer's global index):

    p = embed(tok);  blocks = []
    layer g:  if g > 0: p = p + mlp_out[g-1]                       (rounded to the activation dtype)
              if g % Bs == 0: blocks.append(p)                      (a block-write layer)
              h = AttnRes([blocks[:ceil(g/Bs)], p]);     a = Attn(RMSNorm(h))
              p = a if g % Bs == 0 else p + a
              h = AttnRes([blocks[:ceil(g/Bs) + (g % Bs == 0)], p]);  mlp_out[g] = MLP(RMSNorm(h))
    final:    p = p + mlp_out[last];  h = AttnRes([blocks, p])

Kimi-Linear (no block size):  h += Attn(RMSNorm(h));  h += MLP(RMSNorm(h)).

`Stream` carries this state through the layer loop as a value: `stream_start`, then per layer
`attention_sources` → `mix_norm` (one `attn_res_norm` kernel where it runs) → `ffn_sources` →
`mix_norm` → `ffn_done`, then `stream_final`.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxk3.kernels.attn_res_norm import attn_res
from jaxk3.params import REP, Param, weight


def abstract(hidden: int, prefix: str, name: str) -> tuple[Param, Param]:
    """(norm [D], proj [1, D]) of one AttnRes mix: `<prefix><name>_norm.weight`, `<prefix><name>_proj.weight`."""
    return (weight((hidden,), prefix, f"{name}_norm", spec=REP, init="norm"),
            weight((1, hidden), prefix, f"{name}_proj", spec=REP, init="res"))


@dataclasses.dataclass(frozen=True)
class Stream:
    """The residual stream between blocks (a trace-time value; arrays are [B, D])."""
    p: jax.Array  # K3: the partial sum of the current block; Kimi-Linear: the residual h
    blocks: tuple[jax.Array, ...] = ()  # K3: completed block snapshots
    pending: jax.Array | None = None  # K3: the last MLP output, added before the next layer


def stream_start(x_BD: jax.Array, block_size: int | None, layer_offset: int = 0) -> Stream:
    """The stream after the embedding.  With `layer_offset` > 0 (a slice of a deeper K3 model), the
    block snapshots completed before the slice are stood in for by the embedding (same shapes)."""
    n = 0 if block_size is None else -(-layer_offset // block_size)
    return Stream(p=x_BD, blocks=(x_BD,) * n)


def attention_sources(st: Stream, g: int, block_size: int | None) -> tuple[list[jax.Array], Stream]:
    """The sources the attention block's input mixes (K3: the visible blocks and the partial sum;
    Kimi-Linear: the residual alone), and the stream after them."""
    if block_size is None:
        return [st.p], st
    dt = st.p.dtype
    p = st.p if st.pending is None else (st.p + st.pending).astype(dt)
    blocks = st.blocks + ((p,) if g % block_size == 0 else ())
    nsrc = -(-g // block_size)  # completed blocks visible before attention
    return list(blocks[:nsrc]) + [p], Stream(p=p, blocks=blocks)


def ffn_sources(st: Stream, attn_out: jax.Array, g: int, block_size: int | None) -> tuple[list[jax.Array], Stream]:
    """Adds the attention output; the sources the FFN block's input mixes, and the stream after them."""
    dt = st.p.dtype
    if block_size is None:
        h = (st.p + attn_out).astype(dt)
        return [h], Stream(p=h)
    starts = g % block_size == 0
    p = attn_out.astype(dt) if starts else (st.p + attn_out).astype(dt)
    nsrc = -(-g // block_size) + starts
    return list(st.blocks[:nsrc]) + [p], Stream(p=p, blocks=st.blocks)


def ffn_done(st: Stream, ffn_out: jax.Array, block_size: int | None) -> Stream:
    if block_size is None:
        return Stream(p=(st.p + ffn_out).astype(st.p.dtype))
    return Stream(p=st.p, blocks=st.blocks, pending=ffn_out)


def stream_final(st: Stream, block_size: int | None, res_norm, res_proj, eps: float) -> jax.Array:
    """The input of the final norm: the last AttnRes mix over every block (K3), or the residual."""
    if block_size is None:
        return st.p
    p = (st.p + st.pending).astype(st.p.dtype)
    return attn_res(list(st.blocks) + [p], res_norm, res_proj, eps)
