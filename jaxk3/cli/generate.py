"""`jaxk3 generate`: greedy decoding from a safetensors checkpoint directory (see docs/CHECKPOINTS.md)."""
from __future__ import annotations

import argparse
import re
import sys
import time

import numpy as np

from jaxk3.cli.common import INTERRUPTED, cpu_devices_arg, fail, positive
from jaxk3.tools.memory import device_memory  # noqa: F401  (tests replace it here)
from jaxk3.tools.memory import human_bytes as _bytes

CMD = "jaxk3 generate"
_ID = re.compile(r"[0-9]+")

DESCRIPTION = """\
Load a Kimi-K3 or Kimi-Linear checkpoint (a directory with config.json and *.safetensors files,
optionally sharded with model.safetensors.index.json) onto the local devices, tensor-parallel,
and decode greedily.

Prompt: --prompt TEXT is encoded with the checkpoint's own tokenizer (tiktoken.model +
tokenizer_config.json, needs `pip install tiktoken`) as plain text: "[BOS]" typed in it is five
characters, not the special token, unless --allow-special-tokens is given. --prompt-ids 1,2,3 gives
token ids directly.

Checked before any weight is read (exit 2, one line on stderr): every field of config.json, prompt
length + --max-new-tokens against the checkpoint's max_position_embeddings, the decode cache against
the device memory, token ids against the vocabulary, and --gather ffi / --psum ffi against the rules
of the FFI collectives (the prompt tokens of one prefill dispatch and the prompts per rank, against
JAXK3_GATHER_MAX_ROWS).

Output: the new token ids on stdout, up to and including a stop id (any id of the config's
eos_token_id, one id or a list), and their text when the checkpoint has a tokenizer; progress bars
and the tokens-per-second summary on stderr. Ctrl-C prints the tokens generated so far and exits
with 130; a closed stdout (`| head -1`) ends with one line on stderr and 141.
"""

EXAMPLES = """\
examples:
  jaxk3 generate --checkpoint ./Kimi-K3 --prompt "The capital of France is" --max-new-tokens 32 --tp 8
  jaxk3 generate --checkpoint ./tiny --prompt-ids 1,2,3 --max-new-tokens 8 --cpu-devices 8 --dtype float32
"""


def _ids(text: str) -> list[list[int]]:
    """`1,2,3` is one prompt; `1,2,3;4,5` is a batch of two (split over dp in multi-process runs).
    Spaces around ids are allowed; an empty item (`1,,2`, `1,2,`), an empty prompt (`1;;2`) or
    anything but decimal digits (`-1`, `1.5`, `0x10`) is an error, never dropped."""
    rows = []
    for r, row in enumerate(text.split(";")):
        items = [t.strip() for t in row.split(",")]
        if items == [""]:
            raise argparse.ArgumentTypeError(f"prompt {r + 1} is empty in {text!r}")
        for t in items:
            if t == "":
                raise argparse.ArgumentTypeError(f"empty item in prompt {r + 1} of {text!r} (two commas, or one at "
                                                 "an end): need comma-separated token ids like 1,2,3")
            if t.startswith("-") and _ID.fullmatch(t[1:]):
                raise argparse.ArgumentTypeError(f"negative token id {t} in {text!r}")
            if not _ID.fullmatch(t):
                raise argparse.ArgumentTypeError(f"need comma-separated integers like 1,2,3, got {t!r} in {text!r}")
        rows.append([int(t) for t in items])
    return rows


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="greedy decoding from a safetensors checkpoint directory",
                       description=DESCRIPTION, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="directory with config.json and *.safetensors (K3 or Kimi-Linear naming)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT",
                     help="prompt text, tokenised as plain text (needs the checkpoint's tiktoken.model)")
    src.add_argument("--prompt-ids", type=_ids, metavar="IDS",
                     help="prompt token ids, comma separated: 1,2,3; several prompts (a batch): 1,2,3;4,5")
    g.add_argument("--allow-special-tokens", action="store_true",
                   help="in --prompt text, the text of a special token (e.g. [BOS]) becomes its id")
    g.add_argument("--max-new-tokens", type=positive, default=16, metavar="N",
                   help="tokens to generate (default 16); prompt + N must fit the checkpoint's "
                        "max_position_embeddings and the cache the device memory")
    g.add_argument("--tp", type=positive, default=None, metavar="N",
                   help="tensor-parallel size: use the first N devices (default: all)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype (default bfloat16)")
    g.add_argument("--experts", default="auto", choices=["auto", "mxfp4", "dense"],
                   help="routed experts: kept MXFP4 on the device, dequantised to --dtype at load (dense), or "
                        "auto: as the checkpoint has them (default)")
    g.add_argument("--kernels", default="auto", choices=["auto", "off", "on"],
                   help="device kernels (jaxk3.kernels): where proven and the shapes fit (auto), never, or always")
    g.add_argument("--gather", default="auto", choices=["auto", "ffi", "lax"],
                   help="all-gather implementation: one-shot FFI, lax.all_gather, or auto (default)")
    g.add_argument("--psum", default="auto", choices=["auto", "ffi", "lax"],
                   help="row-parallel sums: the one-shot FFI all-reduce, lax.psum, or auto (default)")
    cpu_devices_arg(g, default=None)
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


def check_args(args) -> str | None:
    """Problems `jaxk3 generate` can see in its arguments alone (cli.check_args calls this)."""
    if args.allow_special_tokens and args.prompt is None:
        return "--allow-special-tokens applies to --prompt text, not to --prompt-ids"
    return None


def cache_len(prompt_len: int, max_new_tokens: int) -> int:
    """Positions `Model.generate` allocates: prompt + new tokens, rounded up to the model's cache
    bucket (at least; the prefill may pad the prompt further)."""
    from jaxk3 import engine

    bucket = engine.CACHE_BUCKET
    return -(-(prompt_len + max_new_tokens) // bucket) * bucket


def check_run(cfg, rows: list[list[int]], max_new_tokens: int, *, tp: int, dp: int, dtype_bytes: int, dtype: str,
              devices: list, mesh=None, gather: str = "auto", psum: str = "auto") -> str | None:
    """What is wrong with decoding `rows` (+ max_new_tokens) with `cfg` on `devices` (this process's
    ranks), before a weight is read: the problem, one line, or None."""
    try:
        cfg.validate_tp(tp)
    except ValueError as e:
        return f"--tp {tp}: {e}"
    for i, r in enumerate(rows):
        bad = [t for t in r if t >= cfg.vocab_size]
        if bad:
            return f"prompt {i + 1}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})"
    T = max(len(r) for r in rows)
    total = T + max_new_tokens
    mpe = cfg.max_position_embeddings
    if mpe is not None and total > mpe:
        if T >= mpe:
            return f"the prompt of {T} tokens fills the model's max_position_embeddings = {mpe}: no room for new tokens"
        return (f"--max-new-tokens {max_new_tokens}: prompt {T} + {max_new_tokens} new = {total} tokens exceeds the "
                f"model's max_position_embeddings = {mpe} (at most {mpe - T} new tokens)")
    batch = -(-len(rows) // dp)  # rows of one data-parallel shard (generate pads the batch to dp)
    length = cache_len(T, max_new_tokens)
    from jaxk3.kernels import kda_decode

    per_rank = cfg.cache_bytes_per_rank(batch, length, tp, dtype_bytes, ring=kda_decode.RING)
    limit, where = device_memory(devices[0])
    if limit is not None:
        # Fake CPU devices share the host's memory: every rank of this process counts.
        ranks = len(devices) if devices[0].platform == "cpu" else 1
        need = per_rank * ranks
        if need > limit:
            times = f" x {ranks} CPU ranks = {_bytes(need)}" if ranks > 1 else ""
            return (f"the decode cache needs {_bytes(per_rank)} per rank (batch {batch} x {length} positions, "
                    f"{dtype}){times}, more than the {_bytes(limit)} of {where}: use fewer prompts or a smaller "
                    f"--max-new-tokens than {max_new_tokens}")
    return ffi_problem(rows, batch, gather=gather, psum=psum, mesh=mesh, cfg=cfg, dtype_bytes=dtype_bytes)


def ffi_problem(rows: list[list[int]], batch: int, *, gather: str, psum: str, mesh, cfg=None,
                dtype_bytes: int = 2) -> str | None:
    """What `--gather ffi` / `--psum ffi` cannot serve, before a weight is read: the problem, or None.

    Every collective of a decode step has one row per prompt of this rank's shard (`batch`: logits,
    MLA latent, the row-parallel sums); those of the prefill have `batch` x the prompt tokens of one
    prefill dispatch (engine.prefill_layout at the chunk `Model.generate` picks: engine.auto_prefill_chunk).  If a one-column probe of that many rows cannot take
    the FFI path (JAXK3_GATHER_MAX_ROWS, the platform, ...), the model's own collectives cannot."""
    if mesh is None or "ffi" not in (gather, psum):
        return None
    from jaxk3 import collectives, engine
    from jaxk3.sharding import TP

    T = max(len(r) for r in rows)
    dev = mesh.devices.flat[0]
    chunk = engine.DEFAULT_PREFILL_CHUNK if cfg is None else engine.auto_prefill_chunk(
        cfg, batch, T, "cpu" if dev.platform == "cpu" else dev.device_kind, dtype_bytes, mesh.shape[TP])
    _, per_dispatch = engine.prefill_layout(T, chunk)
    for option, impl, op, padded, noun in (("--gather", gather, "all_gather", True, "gather"),
                                           ("--psum", psum, "psum", False, "all-reduce")):
        if impl != "ffi":
            continue
        for shape, what in (((batch, per_dispatch, 1), f"the prompt of {T} tokens ({batch} x {per_dispatch} "
                             "rows per prefill step)" if T > 1 else f"{batch} prompts per rank"),
                            ((batch, 1), f"{batch} prompts per rank")):
            p = collectives.plan(shape, "float32", TP, padded=padded, impl="ffi", mesh=mesh, op=op)
            if p.path == "lax":
                return f"{option} ffi: the FFI {noun} cannot serve {what}: {p.reason} (use {option} auto or lax)"
    return None


def run(args) -> int:
    from jaxk3.checkpoint import CheckpointError, load_config
    from jaxk3.engine import load_model
    from jaxk3.collectives import GatherUnavailableError
    from jaxk3.kernels import KernelUnavailableError
    from jaxk3.tokenizer import KimiTokenizer, TokenizerError, TokenizerUnavailableError, has_tokenizer

    from jaxk3 import distributed

    try:
        multi = distributed.initialize_from_args(args)
    except ValueError as e:
        return fail(CMD, e)
    show = not args.no_progress
    tok = None
    try:
        if args.prompt is not None:
            tok = KimiTokenizer.from_dir(args.checkpoint)
            rows = [tok.encode(args.prompt, allow_special=args.allow_special_tokens)]
            if not rows[0]:
                return fail(CMD, "the prompt encodes to no tokens")
        else:
            rows = args.prompt_ids
            if has_tokenizer(args.checkpoint):
                try:
                    tok = KimiTokenizer.from_dir(args.checkpoint)
                except TokenizerUnavailableError:  # no tiktoken: ids still work, without their text
                    tok = None
    except TokenizerError as e:
        return fail(CMD, e)
    try:
        cfg = load_config(args.checkpoint)
    except CheckpointError as e:
        return fail(CMD, e)

    import jax
    from jax.sharding import Mesh

    from jaxk3.sharding import DP, TP

    ndev = len(jax.devices())
    try:
        if multi:
            mesh = distributed.make_mesh(args.tp)
            tp, dp = mesh.shape[TP], mesh.shape[DP]
        else:
            local = jax.local_devices()
            tp, dp = args.tp or len(local), 1
            if tp > len(local):
                return fail(CMD, f"--tp {tp}: only {len(local)} devices present")
            mesh = Mesh(np.array(local[:tp]), (TP,))
    except ValueError as e:
        return fail(CMD, e)
    local_ranks = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    problem = check_run(cfg, rows, args.max_new_tokens, tp=tp, dp=dp, dtype_bytes=jax.numpy.dtype(args.dtype).itemsize,
                        dtype=args.dtype, devices=local_ranks, mesh=mesh, gather=args.gather,
                        psum=args.psum)
    if problem is not None:
        return fail(CMD, problem)

    print(f"loading {args.checkpoint} on {tp} of {ndev} x {jax.devices()[0].device_kind}, "
          f"dtype {args.dtype}", file=sys.stderr, flush=True)
    bar = None

    def on_load(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = _Bar("loading weights", total, "B", show)
        bar.update_to(done)

    t0 = time.perf_counter()
    try:
        model = load_model(args.checkpoint, mesh=mesh if multi else None, tp=None if multi else args.tp,
                           dtype=args.dtype, gather=args.gather, psum=args.psum, progress=on_load,
                           experts=args.experts, kernels=args.kernels)
    except (ValueError, GatherUnavailableError) as e:  # CheckpointError (a ValueError); tp / dtype / gather
        return fail(CMD, e)
    except (MemoryError, jax.errors.JaxRuntimeError) as e:
        return _runtime_failure(e)
    finally:
        if bar is not None:
            bar.close()
    load_s = time.perf_counter() - t0
    print(f"loaded in {load_s:.1f} s (tp={model.tp}, dp={model.dp})", file=sys.stderr, flush=True)

    bars: dict[str, _Bar] = {}

    def on_gen(phase: str, done: int, total: int) -> None:
        if phase not in bars:  # "prompt": the prefill's chunks (long prompts), "decode": new tokens
            bars[phase] = _Bar("prefill" if phase == "prompt" else "generating", total, "tok", show and
                               (phase == "decode" or total > 512))
        bars[phase].update_to(done)
        if done >= total:
            bars[phase].close()

    # one prompt on a terminal with a tokenizer: the text is printed as each chunk of tokens arrives
    stream = tok is not None and len(rows) == 1 and sys.stdout.isatty()
    stops = {int(i) for i in getattr(getattr(model, "cfg", None), "eos_token_ids", ())}
    got: list[list[int]] = [[] for _ in rows]  # each row's new tokens so far, up to its stop id
    ended = [False] * len(rows)

    def on_tokens(chunk) -> None:
        fresh = []
        for i, row in enumerate(chunk[:len(rows)]):
            for t in map(int, row):
                if ended[i]:
                    break
                got[i].append(t)
                ended[i] = t in stops
                if i == 0:
                    fresh.append(t)
        if stream and fresh:
            sys.stdout.write(tok.decode(fresh))
            sys.stdout.flush()

    n_prompt = max(len(r) for r in rows)
    print(f"prompt: {len(rows)} x up to {n_prompt} tokens (the first step compiles the model) ...",
          file=sys.stderr, flush=True)

    try:
        if stream:
            sys.stdout.write("streaming: ")
        out = model.generate(rows, args.max_new_tokens, progress=on_gen, on_tokens=on_tokens)
        if stream:
            sys.stdout.write("\n")
    except (ValueError, GatherUnavailableError, FloatingPointError, KernelUnavailableError) as e:
        return fail(CMD, e)  # FloatingPointError: NaN/Inf logits; KernelUnavailableError: --kernels on
    except (MemoryError, jax.errors.JaxRuntimeError) as e:
        return _runtime_failure(e)
    except KeyboardInterrupt:  # Ctrl-C: what was generated is printed, then one line, exit 130
        for bar in bars.values():
            bar.close()
        if stream:
            sys.stdout.write("\n")
        _print_rows(rows, got, tok)
        sys.stdout.flush()
        print(f"{CMD}: interrupted (Ctrl-C) after {sum(map(len, got))} new tokens; the tokens so far are on "
              "stdout", file=sys.stderr, flush=True)
        return INTERRUPTED
    lengths = getattr(out, "lengths", None)  # a row that produced a stop id ends there (then pad ids)
    _print_rows(rows, [[int(t) for t in toks[:None if lengths is None else int(lengths[i])]]
                       for i, toks in enumerate(out.tokens)], tok)
    sys.stdout.flush()  # a closed pipe shows here, inside the command (exit 141), not at exit
    print(_summary(out, n_prompt, len(rows), args.max_new_tokens), file=sys.stderr)
    return 0


def _print_rows(rows: list[list[int]], new: list[list[int]], tok) -> None:
    for ids, ids_new in zip(rows, new):
        print("prompt ids: " + ",".join(map(str, ids)))
        print("new ids: " + ",".join(map(str, ids_new)))
        if tok is not None:
            print("text: " + tok.decode(ids_new))


def _summary(out, n_prompt: int, batch: int, max_new_tokens: int) -> str:
    """The tokens-per-second line: the decode rate over the tokens after the first of each row."""
    decode_s = getattr(out, "decode_time_s", 0.0) or sum(getattr(out, "step_times_s", None) or [])
    lengths = getattr(out, "lengths", None)
    n_new = int(np.sum(lengths)) if lengths is not None else int(out.tokens.size)
    after_first = max(n_new - batch, 0)
    rate = f"{after_first / decode_s:.1f} tokens/s" if decode_s > 0 and after_first else "n/a"
    total_s = out.prompt_time_s + decode_s
    overall = f"{n_new / total_s:.2f} tokens/s" if total_s > 0 else "n/a"
    ttft = out.prompt_time_s
    prefill = f"{batch * n_prompt / ttft:.0f} prompt tokens/s" if ttft > 0 else "n/a"
    return (f"{n_new} new tokens; time to first token {ttft:.2f} s (prompt {n_prompt} tokens x {batch}: {prefill}; "
            f"the first call includes compilation); decode {rate} ({after_first} tokens after the first of each "
            f"row, batch {batch}, up to {max_new_tokens} each); overall {overall}")


def _runtime_failure(e: BaseException) -> int:
    """Out of memory (host or device) or another XLA runtime error: one line, not a traceback."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return fail(CMD, f"out of memory: {text}")
    raise e
