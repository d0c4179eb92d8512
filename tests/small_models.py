"""Shallower variants of the tiny configs, for tests whose subject does not depend on depth (a layout,
a weight format, a sharding): XLA's compile time grows with the layers, and most of these tests'
time is compiling.  The first four layers keep every kind the tiny models have: KDA (layers 0-2) and
MLA (layer 3) attention, the dense MLP (layer 0) and the MoE (layers 1-3), and in K3 mode two AttnRes
blocks (block size 3: starts at layers 0 and 3); layer l is the tiny model's layer l."""
from __future__ import annotations

import dataclasses

from jaxk3.config import KimiK3Config


def first_layers(cfg: KimiK3Config, n: int = 4) -> KimiK3Config:
    """`cfg` cut to its first `n` layers (kinds and every other field kept)."""
    return dataclasses.replace(cfg, num_hidden_layers=n, layer_attn=cfg.layer_attn[:n], layer_ffn=cfg.layer_ffn[:n])


def tiny_k3_4l(**overrides) -> KimiK3Config:
    return first_layers(KimiK3Config.tiny_k3(**overrides))


def tiny_kimi_linear_4l(**overrides) -> KimiK3Config:
    return first_layers(KimiK3Config.tiny_kimi_linear(**overrides))
