"""`jaxk3 generate`: greedy decoding from a safetensors checkpoint directory (see docs/CHECKPOINTS.md)."""
from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = """\
Load a Kimi-K3 or Kimi-Linear checkpoint (a directory with config.json and *.safetensors files,
optionally sharded with model.safetensors.index.json) onto the local devices, tensor-parallel,
and decode greedily.

Prompt: --prompt TEXT is encoded with the checkpoint's own tokenizer (tiktoken.model +
tokenizer_config.json, needs `pip install tiktoken`); --prompt-ids 1,2,3 gives token ids directly.

Output: the new token ids on stdout (and their text when the checkpoint has a tokenizer);
progress bars and the tokens-per-second summary on stderr.
"""

EXAMPLES = """\
examples:
  jaxk3 generate --checkpoint ./Kimi-K3 --prompt "The capital of France is" --max-new-tokens 32 --tp 8
  jaxk3 generate --checkpoint ./tiny --prompt-ids 1,2,3 --max-new-tokens 8 --cpu-devices 8 --dtype float32
"""


def _ids(text: str) -> list[list[int]]:
    """`1,2,3` is one prompt; `1,2,3;4,5` is a batch of two (split over dp in multi-process runs)."""
    rows = []
    for row in text.replace(" ", "").split(";"):
        try:
            ids = [int(t) for t in row.split(",") if t != ""]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--prompt-ids: need comma-separated integers like 1,2,3, got {text!r}")
        if not ids:
            raise argparse.ArgumentTypeError(f"--prompt-ids: empty prompt in {text!r}")
        rows.append(ids)
    return rows


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"need a positive integer, got {text!r}")
    return int(text)


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="greedy decoding from a safetensors checkpoint directory",
                       description=DESCRIPTION, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="directory with config.json and *.safetensors (K3 or Kimi-Linear naming)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the checkpoint's tiktoken.model)")
    src.add_argument("--prompt-ids", type=_ids, metavar="IDS",
                     help="prompt token ids, comma separated: 1,2,3; several prompts (a batch): 1,2,3;4,5")
    g.add_argument("--max-new-tokens", type=_positive, default=16, metavar="N", help="tokens to generate (default 16)")
    g.add_argument("--tp", type=_positive, default=None, metavar="N",
                   help="tensor-parallel size: use the first N devices (default: all)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype; MXFP4 experts are dequantised to it (default bfloat16)")
    g.add_argument("--gather", default="auto", choices=["auto", "ffi", "lax"],
                   help="all-gather implementation: one-shot FFI, lax.all_gather, or auto (default)")
    g.add_argument("--cpu-devices", type=int, default=None, metavar="N", help="run on N fake CPU devices")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    from jaxk3 import distributed

    distributed.add_cli_args(g)
    return g


class _Bar:
    """A progress bar on stderr: tqdm when installed, else a plain one-line bar."""

    def __init__(self, desc: str, total: int, unit: str, enabled: bool, scale: float = 1.0):
        self.desc, self.total, self.unit, self.enabled, self.scale = desc, total, unit, enabled, scale
        self.n, self._tq = 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self._tq = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                                leave=True, dynamic_ncols=True)
            except ImportError:
                pass

    def update_to(self, n: int) -> None:
        if not self.enabled:
            return
        if self._tq is not None:
            self._tq.update(n - self.n)
        else:
            frac = n / max(self.total, 1)
            sys.stderr.write(f"\r{self.desc}: [{'#' * int(30 * frac):<30}] {100 * frac:5.1f}%")
            sys.stderr.flush()
        self.n = n

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tq is not None:
            self._tq.close()
        else:
            sys.stderr.write("\n")


def run(args) -> int:
    from jaxk3.checkpoint import CheckpointError, load_model
    from jaxk3.tokenizer import KimiTokenizer, TokenizerError, has_tokenizer

    from jaxk3 import distributed

    try:
        multi = distributed.initialize_from_args(args)
    except ValueError as e:
        print(f"jaxk3 generate: {e}", file=sys.stderr)
        return 2
    show = not args.no_progress
    tok = None
    try:
        if args.prompt is not None:
            tok = KimiTokenizer.from_dir(args.checkpoint)
            rows = [tok.encode(args.prompt)]
            if not rows[0]:
                print("jaxk3 generate: the prompt encodes to no tokens", file=sys.stderr)
                return 2
        else:
            rows = args.prompt_ids
            if has_tokenizer(args.checkpoint):
                try:
                    tok = KimiTokenizer.from_dir(args.checkpoint)
                except TokenizerError:
                    tok = None
    except TokenizerError as e:
        print(f"jaxk3 generate: {e}", file=sys.stderr)
        return 2

    import jax

    ndev = len(jax.devices())
    print(f"loading {args.checkpoint} on {args.tp or ndev} of {ndev} x {jax.devices()[0].device_kind}, "
          f"dtype {args.dtype}", file=sys.stderr, flush=True)
    bar = None

    def on_load(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = _Bar("loading weights", total, "B", show)
        bar.update_to(done)

    t0 = time.perf_counter()
    try:
        mesh = distributed.make_mesh(args.tp) if multi else None
        model = load_model(args.checkpoint, mesh=mesh, tp=None if multi else args.tp, dtype=args.dtype,
                           gather=args.gather, progress=on_load)
    except CheckpointError as e:
        print(f"jaxk3 generate: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # tp / dtype / gather
        print(f"jaxk3 generate: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    load_s = time.perf_counter() - t0
    print(f"loaded in {load_s:.1f} s (tp={model.tp}, dp={model.dp})", file=sys.stderr, flush=True)

    bars: dict[str, _Bar] = {}

    def on_gen(phase: str, done: int, total: int) -> None:
        if phase != "decode":
            return
        if phase not in bars:
            bars[phase] = _Bar("generating", total, "tok", show)
        bars[phase].update_to(done)
        if done >= total:
            bars[phase].close()

    n_prompt = max(len(r) for r in rows)
    print(f"prompt: {len(rows)} x up to {n_prompt} tokens (the first step compiles the model) ...",
          file=sys.stderr, flush=True)

    try:
        out = model.generate(rows, args.max_new_tokens, progress=on_gen)
    except ValueError as e:
        print(f"jaxk3 generate: {e}", file=sys.stderr)
        return 2
    for ids, toks in zip(rows, out.tokens):
        new = [int(t) for t in toks]
        print("prompt ids: " + ",".join(map(str, ids)))
        print("new ids: " + ",".join(map(str, new)))
        if tok is not None:
            print("text: " + tok.decode(new))
    steps = out.step_times_s
    decode_s = sum(steps)
    tps = len(steps) / decode_s if decode_s > 0 else float("nan")
    total_s = out.prompt_time_s + decode_s
    n_new = out.tokens.size
    print(f"{n_new} new tokens; prompt {n_prompt} steps in {out.prompt_time_s:.2f} s (includes compile); "
          f"decode {tps * len(rows):.1f} tokens/s ({len(steps)} steps after the first, batch {len(rows)}); "
          f"overall {n_new / total_s:.2f} tokens/s", file=sys.stderr)
    return 0
