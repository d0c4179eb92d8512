"""Decode-time blocks of Kimi-K3 / Kimi-Linear, one file a block, pure functions.

Shape glossary (dimension-suffix names such as `x_BD`, `q_BHK`):

    B  batch rows (one new token each)     D  hidden size
    V  vocab rows (local shard under TP)   H  heads (local under TP)
    K  key head dim    Vd value head dim   C  channels of a KDA projection (H*K, local)
    W  conv window (short_conv_kernel_size - 1 cached steps; K slots as the ring, kernels.kda_decode.RING)
    S  MLA cache slots (positions)         R  latent width kv_lora_rank + qk_rope_head_dim
    N  AttnRes sources (depth)             E  experts   k  experts per token
    I  FFN intermediate (local)            L  routed-expert (latent) width

Every block takes `tp` (`layers.common.TP`, or a bare axis name): the mesh axis when called inside
`jax.shard_map` (row-parallel outputs are then summed over it, through the collectives it names),
or None on one device (no collectives).  Every block file also declares its weights once
(`abstract(cfg, prefix)`, `jaxk3.params`) and, for attention, its per-row cache (`cache_abstract`).
"""
