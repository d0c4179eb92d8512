"""`jaxk3 init-checkpoint`: a small random checkpoint in the hub layout, to try `generate`, `info` and
`load_model` in a minute without downloading anything (the README's quick start)."""
from __future__ import annotations

import argparse
import glob
import os

from jaxk3.cli.common import fail, int_in

CMD = "jaxk3 init-checkpoint"
PRESETS = ("tiny", "tiny-kimi-linear")
# what a checkpoint directory holds that this command writes (and replaces with --force)
WRITTEN = ("config.json", "*.safetensors", "model.safetensors.index.json")

DESCRIPTION = """\
Write a checkpoint with random weights into DIR, in the layout load_model and `jaxk3 generate` read:
config.json + model.safetensors (docs/CHECKPOINTS.md). --config tiny is the tiny Kimi-K3 (nested
text_config, `language_model.` names, 8 layers, 1000 ids, 14 MB in bfloat16); tiny-kimi-linear the tiny
Kimi-Linear (flat names); PATH a config.json (or a directory holding one) of any size: mind the disk
(K3 at full size is terabytes). The tokens a random model generates mean nothing; the point is that
every path (loading, sharding, prefill, decode) runs.
"""

EXAMPLES = """\
examples:
  jaxk3 init-checkpoint --config tiny ./tiny-k3
  jaxk3 generate --checkpoint ./tiny-k3 --prompt-ids 1,2,3 --max-new-tokens 8
  jaxk3 init-checkpoint --config tiny ./tiny-k3-mxfp4 --mxfp4 --dtype bfloat16 --seed 1
"""


def add_parser(sub) -> None:
    p = sub.add_parser("init-checkpoint", help="write a small random checkpoint (to try generate / info / load_model)",
                       description=DESCRIPTION, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="tiny|tiny-kimi-linear|PATH",
                   help="the model: a tiny preset, or a HF config.json / a directory holding one")
    p.add_argument("dir", metavar="DIR", help="where to write it (created; must be empty unless --force)")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1, "a seed"), default=0, help="random seed (default 0)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the weights on disk (default bfloat16; norms, gates and A_log stay float32)")
    p.add_argument("--mxfp4", action="store_true",
                   help="routed experts as MXFP4 (packed uint8 + scales, compressed-tensors' mxfp4-pack-quantized), "
                        "as Kimi-K3 ships them")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty DIR, replacing its config.json, *.safetensors and index")


def check_args(args) -> str | None:
    """What `jaxk3 init-checkpoint` can see before anything is written (cli.check_args calls this)."""
    from jaxk3.cli.common import config_problem

    if args.config not in PRESETS and (problem := config_problem(args.config, presets=PRESETS)):
        return problem
    d = args.dir
    if not d.strip():
        return f"DIR: needs a directory name, got {d!r}"
    if os.path.exists(d) and not os.path.isdir(d):
        return f"{d}: exists and is not a directory"
    if os.path.isdir(d) and os.listdir(d) and not args.force:
        return f"{d}: is not empty (--force writes into it, replacing {', '.join(WRITTEN)})"
    parent = os.path.dirname(os.path.abspath(d))
    if not os.path.isdir(d) and not os.path.isdir(parent):
        return f"{d}: the directory {parent} does not exist"
    if not os.access(d if os.path.isdir(d) else parent, os.W_OK):
        return f"{d}: not writable"
    return None


def config_of(name: str):
    from jaxk3.config import KimiK3Config

    if name == "tiny":
        return KimiK3Config.tiny_k3()
    if name == "tiny-kimi-linear":
        return KimiK3Config.tiny_kimi_linear()
    return KimiK3Config.from_pretrained(name)


def k3_layout(cfg) -> bool:
    """K3's hub layout (nested text_config, `language_model.` prefix) for a K3-mode config (AttnRes,
    the lower-bounded gate or the latent MoE on); Kimi-Linear's flat one otherwise."""
    return (cfg.attn_res_block_size is not None or cfg.gate_lower_bound is not None
            or cfg.routed_expert_hidden_size is not None)


def split_mxfp4(flat: dict) -> tuple[dict, dict]:
    """random_hf_weights of an MXFP4 config holds `….weight_packed` / `….weight_scale` bytes for the
    routed experts: (the other tensors, {base: (packed, scale)} as save_checkpoint takes them)."""
    packed = {k[: -len(".weight_packed")]: (v, flat[k[: -len("packed")] + "scale"])
              for k, v in flat.items() if k.endswith(".weight_packed")}
    rest = {k: v for k, v in flat.items() if not k.endswith((".weight_packed", ".weight_scale"))}
    return rest, packed


def run(args) -> int:
    import dataclasses

    import ml_dtypes
    import numpy as np

    from jaxk3 import checkpoint
    from jaxk3.model import random_hf_weights

    try:
        cfg = config_of(args.config)
        if args.mxfp4:
            if "moe" not in cfg.layer_ffn:
                return fail(CMD, f"--mxfp4: --config {args.config} has no MoE layer, so no routed experts")
            cfg = dataclasses.replace(cfg, experts_format="mxfp4")  # checks the widths against the MXFP4 group
    except ValueError as e:
        return fail(CMD, e)
    flat, packed = split_mxfp4(random_hf_weights(cfg, args.seed))
    os.makedirs(args.dir, exist_ok=True)
    if args.force:
        for pattern in WRITTEN:
            for f in glob.glob(os.path.join(args.dir, pattern)):
                if os.path.isfile(f):
                    os.remove(f)
    dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[args.dtype]
    try:
        checkpoint.save_checkpoint(args.dir, dataclasses.replace(cfg, experts_format="dense"), flat,
                                   k3_layout=k3_layout(cfg), mxfp4_experts=packed or None, dtype=dtype)
    except OSError as e:
        return fail(CMD, f"{args.dir}: cannot write ({e.strerror or e})")
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(args.dir, "*.safetensors")))
    kind = "Kimi-K3" if k3_layout(cfg) else "Kimi-Linear"
    experts = "MXFP4" if args.mxfp4 else args.dtype
    print(f"wrote {args.dir}: a random {kind} checkpoint ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, weights {args.dtype}, routed experts {experts}, seed {args.seed}; "
          f"{size / 1e6:.1f} MB)")
    print(f"try: jaxk3 generate --checkpoint {args.dir} --prompt-ids 1,2,3 --max-new-tokens 8")
    return 0
