"""The user-facing model: `Model` (generate, score, step, init_cache), `load_model` and
`init_random_model`.

It runs what the layers below it build: the forward and the decode step (jaxk3.model), the chunked
prefill, sampling and the decode loop (jaxk3.generation), and the checkpoint reader
(jaxk3.checkpoint).  `import jaxk3` exports these names.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3 import checkpoint, generation, params
from jaxk3.config import KimiK3Config
from jaxk3.kernels import kda_decode
from jaxk3.layers.mla import MLACache
from jaxk3.model import (Cache, StepOptions, Weights, abstract_weights, build_step, cache_abstract, check_impl,
                         check_kernels, dp_axis, make_mesh, put_batch, put_rows, random_hf_weights, resolve_dtype,
                         resolve_layout, serve_weights, host_slices, to_host)
from jaxk3.sharding import DP, TP as TP_AXIS

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per row per prefill dispatch: the least `auto_prefill_chunk` picks
MAX_PREFILL_TOKENS = 8192  # rows x chunk of one prefill dispatch, at most, when the chunk is chosen (activations)
# MLA's prefill holds fp32 scores [rows, chunk, heads per rank, cached positions]: at most this many bytes when
# the chunk is chosen.  4 GiB is 48B's B 8 x 1024 x 32 heads x 4K, measured to fit beside its 91.5 GiB of
# weights on an H200 (its temporaries ~5x the scores: 10.4 GiB at B 1 x 4096).
MAX_PREFILL_SCORE_BYTES = 1 << 32
# A GPU's bf16 GEMM rate over its copy bandwidth (FLOP per byte read): where a prefill chunk turns from
# reading weights to computing.  H200: 660 TFLOP/s (the MoE's GEMM shape) / 4.0 TB/s, measured (docs/PERF.md);
# other GPUs are taken as alike.
GPU_FLOP_PER_BYTE = {"H200": 165.0}
DEFAULT_GPU_FLOP_PER_BYTE = 165.0
# generate/score round the latent cache's length up to this: one compiled prefill and decode loop
# serve every prompt + max_new_tokens within a bucket (each new cache shape is a new compile)
CACHE_BUCKET = 512


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, N] int32, the new tokens only (after a row's stop id: pad_id)
    logits: np.ndarray | None  # [B, N, vocab] float32: the logits each new token was chosen from
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # step_by_step: wall time of each decode step
    prompt_time_s: float = 0.0  # time to first token: the prompt, synchronised at its end (includes any compile)
    decode_time_s: float = 0.0  # from the first new token to the last, on the host
    lengths: np.ndarray | None = None  # [B] new tokens per row up to and including its stop id
    prompt_tokens: int = 0  # tokens per row the prefill processed (the longest prompt, padded)


# XLA's CPU client runs every device's part of a launch on a shared pool and blocks a thread per
# device part while it waits in a collective; launches of several programs interleaved across
# threads could then wait on each other with no thread left to run the part they need (seen: two
# threads with two models aborted the process in XLA's all-reduce).  On CPU, a Model therefore
# runs one call at a time, process-wide, and waits for its results before the next call starts.
_CPU_CALLS = threading.RLock()


class Model:
    """A tiny-to-real Kimi-K3 / Kimi-Linear decoder, sharded over a "tp" mesh axis.  Build with
    `init_random_model`, `Model.from_weights` or `jaxk3.load_model`; decode with `generate`."""

    def __init__(self, cfg: KimiK3Config, weights: Weights, mesh: Mesh, dtype: Any, gather: str,
                 shard_latent: bool, psum: str = "auto", kernels: str = "auto", layout: str = "auto",
                 donate_weights: bool = False):
        """`weights`: placed, in the checkpoint layout; `layout` "auto" | "serving" | "checkpoint"
        (jaxk3.model.resolve_layout): the serving layout joins same-input projections at load.
        `donate_weights`: the joined members' arrays are deleted as they are joined (peak memory: the
        weights plus one fused array); the caller must not use `weights` again."""
        self.serving = resolve_layout(layout, mesh.devices.flat[0].platform)
        self.layout = "serving" if self.serving else "checkpoint"
        self.cfg, self.mesh = cfg, mesh
        self.weights = serve_weights(weights, mesh, donate_weights) if self.serving else weights
        self.dtype, self.gather, self.psum, self.shard_latent = jnp.dtype(dtype), gather, psum, shard_latent
        self.kernels = check_kernels(kernels)
        self.tp = mesh.shape[TP_AXIS]
        # An optional "dp" mesh axis splits the batch (jaxk3.distributed.make_mesh: DP across
        # processes, TP inside each); weights are replicated over it.
        self.dp_axis = dp_axis(mesh)
        self.dp = mesh.shape[DP] if self.dp_axis else 1
        self.abstract = abstract_weights(cfg, self.tp)
        self.opt = StepOptions(tp_axis=TP_AXIS, gather=gather, psum=psum, shard_latent=shard_latent,
                               kernels=kernels, serving=self.serving)
        self._step = build_step(cfg, self.opt, mesh)
        self._fns: dict = {}

    def with_kernels(self, kernels: str) -> "Model":
        """The same model (the same weight arrays, not copied) with another `kernels` mode ("auto" | "on"
        | "off"), its own compiled functions: a baseline beside the model in one process (benches)."""
        other = copy.copy(self)
        other.kernels = check_kernels(kernels)
        other.opt = dataclasses.replace(self.opt, kernels=other.kernels)
        other._step = build_step(self.cfg, other.opt, self.mesh)
        other._fns = {}
        return other

    # -- constructors
    @classmethod
    def from_weights(cls, cfg: KimiK3Config, weights: Mapping[str, Any] | Weights, mesh: Mesh | None = None,
                     tp: int | None = None, dtype: Any = "bfloat16", gather: str = "auto",
                     shard_latent: bool = True, psum: str = "auto", check_finite: bool = True,
                     experts: str | None = None, kernels: str = "auto", layout: str = "auto") -> "Model":
        """From host arrays keyed by HF checkpoint names (or a host `Weights` pytree); every array is
        checked for NaN/Inf unless `check_finite=False` (checkpoint.NonFiniteTensorError names it).
        `experts` ("auto" | "mxfp4" | "dense", as in load_model; None: `cfg.experts_format`) picks how
        the routed experts are held."""
        check_impl("gather", gather), check_impl("psum", psum), check_kernels(kernels)
        mesh = make_mesh(mesh, tp)
        resolve_layout(layout, mesh.devices.flat[0].platform)
        dt = resolve_dtype(dtype)
        tp_size = mesh.shape[TP_AXIS]
        source = None if isinstance(weights, Weights) else checkpoint.ArraySource(weights)
        cfg.validate_tp(tp_size, shard_latent=shard_latent)
        if experts is not None:
            if source is None and experts == "auto":
                raise ValueError("experts='auto' needs arrays keyed by checkpoint name (a Weights tree "
                                 "follows cfg.experts_format)")
            cfg = checkpoint.resolve_experts(cfg, source, experts, tp_size, shard_latent)
        if source is None:
            plan = checkpoint.plan_from_arrays(abstract_weights(cfg, tp_size), weights)
        else:
            plan = checkpoint.build_plan(cfg, source, tp_size)
        placed = checkpoint.place_plan(plan, mesh, dt, shard_latent, check_finite=check_finite)
        cfg, placed = checkpoint.mark_experts_f16(cfg, placed)
        # donate what place_plan made from host arrays; a Weights tree may hold the caller's device arrays
        return cls(cfg, placed, mesh, dt, gather, shard_latent, psum, kernels, layout, donate_weights=source is not None)

    # -- decoding
    def init_cache(self, batch: int, max_len: int) -> Cache:
        if batch % self.dp:
            raise ValueError(f"batch: {batch} rows do not split over dp={self.dp} (generate pads for you)")
        # Created in place on every device (also across processes), never on one host first, by one
        # jitted function per cache shape (compiled once: a function per buffer and call used to compile
        # every buffer on every call, ~0.9 s for a tiny model's 14 buffers on a CPU, each generate/score).
        def build():
            abstract = cache_abstract(self.cfg, batch, max_len)
            specs = params.buffer_specs(abstract, self.dp_axis)
            shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
            dt = self.dtype
            return jax.jit(lambda: jax.tree.map(lambda b: jnp.zeros(b.shape, b.np_dtype(dt)), abstract,
                                                is_leaf=params.is_buffer), out_shardings=shardings)

        return self._fn(("cache", batch, max_len), build)()

    def step(self, cache: Cache, tokens_B: Any, valid_B: Any = None) -> tuple[jax.Array, jax.Array, Cache]:
        """One jitted decode step (cache donated): (logits [B, vocab] fp32, argmax [B], new cache).

        Checks first (ValueError): the cache was not donated to an earlier step, it matches this
        batch, and no row would write past its capacity.  The capacity check reads the cache's
        lengths, so each call waits for the step before it (`generate` is the fast path)."""
        tokens_B = np.asarray(tokens_B)
        if tokens_B.ndim != 1 or tokens_B.dtype.kind not in "iu" or np.any(
                (tokens_B < 0) | (tokens_B >= self.cfg.vocab_size)):
            raise ValueError(f"tokens_B: need a [B] array of integer ids in [0, {self.cfg.vocab_size}), got {tokens_B}")
        tokens_B = tokens_B.astype(np.int32)
        valid_B = np.ones(tokens_B.shape, bool) if valid_B is None else np.asarray(valid_B, bool)
        if valid_B.shape != tokens_B.shape:
            raise ValueError(f"valid_B: shape {valid_B.shape} differs from tokens_B's {tokens_B.shape}")
        with self._exclusive():
            self._check_cache(cache, tokens_B.shape[0], valid_B)
            # the same input sharding as the fed-back argmax: one compile
            out = self._step(self.weights, cache, put_batch(tokens_B, self.mesh), put_batch(valid_B, self.mesh))
            if self._on_cpu:
                jax.block_until_ready(out)
            return out

    def _check_cache(self, cache: Cache, batch: int, valid_B: np.ndarray) -> None:
        if not isinstance(cache, Cache):
            raise TypeError(f"cache: need the Cache from init_cache or the step before, got {type(cache).__name__}")
        if any(a.is_deleted() for a in jax.tree.leaves(cache)):
            raise ValueError("cache: it was donated to an earlier step and no longer exists; pass the cache that "
                             "step returned")
        if cache.length.shape != (batch,):
            raise ValueError(f"cache: made for {cache.length.shape[0]} rows, the step has {batch}")
        slots = min((c.kv.shape[1] for c in cache.layers if isinstance(c, MLACache)), default=None)
        if slots is not None:
            need = int(np.max(to_host(cache.length) + valid_B))
            if need > slots:
                raise ValueError(f"cache: full: a row would hold {need} tokens in a cache of {slots} slots "
                                 f"(make it with init_cache(batch, max_len >= {need}))")

    def _check_prompts(self, prompt_ids: Any) -> list[list[int]]:
        """Rows of int token ids: a list of sequences, or a [B, T] integer array (TypeError/ValueError)."""
        if isinstance(prompt_ids, (str, bytes)):
            raise TypeError("prompt_ids: need token ids (a list of rows of ints), got a string: tokenize it first")
        if isinstance(prompt_ids, np.ndarray) or hasattr(prompt_ids, "shape"):
            arr = np.asarray(prompt_ids)
            if arr.ndim != 2 or arr.dtype.kind not in "iu":
                raise ValueError(f"prompt_ids: an array must be [B, T] of integers, got {arr.dtype} of shape {arr.shape}")
            rows = [list(map(int, r)) for r in arr]
        else:
            try:
                raw = list(prompt_ids)
            except TypeError:
                raise TypeError(f"prompt_ids: need a list of rows of token ids, got {type(prompt_ids).__name__}") from None
            rows = []
            for i, r in enumerate(raw):
                if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
                    raise TypeError(f"prompt_ids: row {i} is {r!r}, not a sequence of token ids (a batch of one "
                                    f"prompt is [[1, 2, 3]])")
                row = list(r)
                for t in row:
                    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                        raise TypeError(f"prompt_ids: row {i} has {t!r} ({type(t).__name__}); token ids are ints")
                rows.append([int(t) for t in row])
        if not rows:
            raise ValueError("prompt_ids: empty batch")
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"prompt_ids: row {i} is empty")
            bad = [t for t in r if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt_ids: row {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        return rows

    @property
    def _on_cpu(self) -> bool:
        return self.mesh.devices.flat[0].platform == "cpu"

    def _exclusive(self):
        """One call at a time on CPU meshes (see _CPU_CALLS); nothing on GPU."""
        return _CPU_CALLS if self._on_cpu else contextlib.nullcontext()

    # -- generation
    def _fn(self, key: tuple, build):
        if key not in self._fns:
            self._fns[key] = build()
        return self._fns[key]

    def prefill_chunk_for(self, batch: int, prompt_len: int) -> int:
        """The prefill chunk `generate` and `score` take for `batch` prompts of at most `prompt_len` tokens
        when `prefill_chunk` is None (`auto_prefill_chunk`, per DP group of rows)."""
        dev = self.mesh.devices.flat[0]
        return auto_prefill_chunk(self.cfg, -(-batch // self.dp), prompt_len,
                                  "cpu" if dev.platform == "cpu" else dev.device_kind, self.dtype.itemsize, self.tp)

    def _chunk(self, prefill_chunk: Any, rows: list[list[int]]) -> int:
        if prefill_chunk is None:
            return self.prefill_chunk_for(len(rows), max(len(r) for r in rows))
        return _check_chunk(prefill_chunk)

    def _layout(self, rows: list[list[int]], chunk: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Left-padded [Bp, T_total] tokens and valid mask: T_total a multiple of the prefill chunk
        (or of 64, for prompts shorter than a chunk; or T itself up to 64: the KDA chunk)."""
        Tt, per_dispatch = prefill_layout(max(len(r) for r in rows), chunk)
        toks, valid = self._left_pad(rows, Tt)
        return toks, valid, per_dispatch

    def _left_pad(self, rows: list[list[int]], T: int) -> tuple[np.ndarray, np.ndarray]:
        """[Bp, T] tokens and valid mask, each row's tokens at the end (rows added to split the batch
        over dp are all padding)."""
        Bp = -(-len(rows) // self.dp) * self.dp
        toks = np.zeros((Bp, T), np.int32)
        valid = np.zeros((Bp, T), bool)
        for i, r in enumerate(rows):
            toks[i, T - len(r):], valid[i, T - len(r):] = r, True
        return toks, valid

    def _prefill(self, cache: Cache, toks: np.ndarray, valid: np.ndarray, chunk: int, all_logits: bool,
                 sampling: generation.Sampling | None, progress=None):
        opt = self.opt
        fn = self._fn(("prefill", all_logits, sampling),
                      lambda: generation.build_prefill(self.cfg, opt, self.mesh, all_logits, sampling))
        outs, first, finite = [], None, None
        for c0 in range(0, toks.shape[1], chunk):
            logits, first, finite, cache = fn(self.weights, cache, put_rows(toks[:, c0:c0 + chunk], self.mesh),
                                              put_rows(valid[:, c0:c0 + chunk], self.mesh), np.int32(0))
            outs.append(logits)
            if progress is not None:
                progress("prompt", min(c0 + chunk, toks.shape[1]), toks.shape[1])
        return outs, first, finite, cache

    def score(self, token_ids: Any, prefill_chunk: int | None = None, host: bool = True) -> np.ndarray | jax.Array:
        """float32 logits at every position, [B, T, vocab], through the prefill path (what a transformers forward pass
        returns).  Ragged rows: row i's logits are out[i, :len_i], the rest NaN.  `host` True: a numpy array (a 4K row
        of Kimi's vocabulary is 2.7 GB, copied through pinned host memory); False: a jax.Array left on the devices
        (the same values; no host copy: the prefill's time), as a torch model's logits stay on its GPU."""
        if not isinstance(host, bool):
            raise ValueError(f"host: must be True (a numpy array) or False (a jax.Array on the devices), got {host!r}")
        with self._exclusive():
            return self._score(token_ids, prefill_chunk, host)

    def _score(self, token_ids: Any, prefill_chunk: int | None, host: bool = True) -> np.ndarray | jax.Array:
        rows = self._check_prompts(token_ids)
        toks, valid, chunk = self._layout(rows, self._chunk(prefill_chunk, rows))
        cache = self.init_cache(toks.shape[0], -(-toks.shape[1] // CACHE_BUCKET) * CACHE_BUCKET)
        outs, _, _, _ = self._prefill(cache, toks, valid, chunk, True, None)
        if not host:  # each row's positions from the right-aligned padded layout to the start, NaN after its end
            B, Tt = len(rows), toks.shape[1]
            lens = [len(r) for r in rows]
            if len(outs) == 1 and outs[0].shape[0] == B and min(lens) == Tt:
                out = outs[0]  # nothing to move
            else:
                V = self.cfg.vocab_size
                # rows over dp where they divide, else the vocabulary: never the whole array on every device
                spec = (P(DP) if B % self.dp == 0 else P(None, None, DP) if V % self.dp == 0 else P()) \
                    if self.dp_axis else P()
                out = _rows_to_start(tuple(outs), jnp.asarray(lens, jnp.int32), max(lens),
                                     NamedSharding(self.mesh, spec))
            del outs
            if self._on_cpu:
                jax.block_until_ready(out)  # see _CPU_CALLS
            return out
        # Each chunk's logits go straight to their place (a 4K row's are 2.7 GB at Kimi's vocabulary: no concatenated
        # copy, and NaN only past a row's end), slice by slice through pinned host memory (`host_slices`), each
        # slice copied by several threads (the fresh array's page faults are most of a single copy's time).
        T, Tt = max(len(r) for r in rows), toks.shape[1]
        out = np.empty((len(rows), T, self.cfg.vocab_size), np.float32)
        threads = max(1, min(16, os.cpu_count() or 1))  # 16: 0.10 s against 8: 0.13 s to place 2.7 GB (PERF.md)
        with ThreadPoolExecutor(threads) as pool:
            # While the device runs the prefill (dispatched, not waited for), every page of the fresh output is
            # touched once, NaN (what stays past a row's end): the first touch of 2.7 GB is most of a copy into it.
            _fill(pool, threads, out.reshape(-1, out.shape[-1]), np.nan)
            for ci, o in enumerate(outs):
                for s0, s1, host in host_slices(o, axis=1):
                    a0, a1 = ci * chunk + s0, ci * chunk + s1  # the slice's positions in the padded layout
                    for i, r in enumerate(rows):
                        lo = max(a0, Tt - len(r))  # row i's tokens sit at [Tt - len(r), Tt) of the padded layout
                        if lo < a1:
                            _copy(pool, threads, out[i, lo - (Tt - len(r)):a1 - (Tt - len(r))], host[i, lo - a0:])
        return out

    def generate(self, prompt_ids: Any, max_new_tokens: int, return_logits: bool = False, progress: Any = None, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop_ids: Any = None, on_tokens: Any = None, prefill_chunk: int | None = None,
                 decode_chunk: int = 32, step_by_step: bool = False) -> GenerateOutput:
        """Generate `max_new_tokens` per prompt: the prompt through the chunked prefill, then the
        decode loop on the device, `decode_chunk` tokens per dispatch.

        Ragged prompts are left-padded; pad tokens do not touch a row's caches, so each row gets the
        tokens of running it alone.  Sampling: greedy by default; `temperature`, `top_k`, `top_p`,
        `seed` (see jaxk3.generation.Sampling).  A row stops after producing one of `stop_ids`
        (default: every id of the config's eos_token_ids, HF's eos_token_id, one id or a list); its later tokens are the config's pad id (else
        -1) and `lengths` counts its tokens.  `on_tokens(tokens [B, n])` streams each chunk of new
        tokens as it arrives; `progress(phase, done, total)` reports "prompt" tokens and "decode"
        tokens.  `step_by_step=True` runs the prompt and the decode one token per dispatch (the
        original path, greedy only; kept for tests)."""
        with self._exclusive():
            return self._generate(prompt_ids, max_new_tokens, return_logits, progress, temperature, top_k, top_p,
                                  seed, stop_ids, on_tokens, prefill_chunk, decode_chunk, step_by_step)

    def _generate(self, prompt_ids, max_new_tokens, return_logits, progress, temperature, top_k, top_p, seed,
                  stop_ids, on_tokens, prefill_chunk, decode_chunk, step_by_step) -> GenerateOutput:
        rows = self._check_prompts(prompt_ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        sampling = generation.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if not isinstance(decode_chunk, (int, np.integer)) or decode_chunk < 1:
            raise ValueError(f"decode_chunk: must be an int >= 1, got {decode_chunk!r}")
        stops = _check_stop_ids(stop_ids, self.cfg)
        if step_by_step:
            self._check_length(rows, max_new_tokens)
            if not sampling.greedy:
                raise ValueError("step_by_step=True decodes greedily: leave temperature at 0")
            return self._generate_step_by_step(rows, max_new_tokens, return_logits, progress)
        self._check_length(rows, max_new_tokens)
        pad_id = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else -1
        B = len(rows)
        toks, valid, chunk = self._layout(rows, self._chunk(prefill_chunk, rows))
        Bp, Tt = toks.shape
        K = int(min(decode_chunk, max(max_new_tokens - 1, 1)))  # the last chunk runs K steps too (unused ones dropped)
        cache = self.init_cache(Bp, -(-(Tt + max_new_tokens + K) // CACHE_BUCKET) * CACHE_BUCKET)
        t0 = time.perf_counter()
        outs, first, finite, cache = self._prefill(cache, toks, valid, chunk, False, sampling, progress)
        first_np = to_host(first)
        ttft = time.perf_counter() - t0
        _raise_if_not_finite(~to_host(finite)[:B], "the first new token (the prompt's last position)")
        done_np = np.isin(first_np, stops) | (np.arange(Bp) >= B)
        out_t = [first_np[:, None]]
        out_l = [to_host(outs[-1])[:, None].astype(np.float32)] if return_logits else []
        if on_tokens is not None:
            on_tokens(first_np[:B, None])
        if progress is not None:
            progress("decode", 1, max_new_tokens)
        t1 = time.perf_counter()
        left = 0 if np.all(done_np) else max_new_tokens - 1
        opt = self.opt
        loop = None if left == 0 else self._fn(
            ("loop", K, sampling, stops, pad_id, return_logits),
            lambda: generation.build_decode_loop(self.cfg, opt, self.mesh, K, sampling, stops, pad_id, return_logits))
        tok, done = first, put_batch(done_np, self.mesh)
        pending, produced, position = None, 1, 1
        while left > 0 or pending is not None:
            launched = None
            if left > 0:  # the next chunk is queued before the previous one is read
                n = min(K, left)
                t_B, l_B, cache, tok, done, bad = loop(self.weights, cache, tok, done, np.int32(position))
                launched, position, left = (t_B, l_B, done, bad, n), position + K, left - n
            if pending is not None:
                t_B, l_B, d_B, bad_B, n = pending
                _raise_if_not_finite(to_host(bad_B)[:B], f"new tokens {produced + 1}..{produced + n}")
                got = to_host(t_B)[:, :n]
                out_t.append(got)
                if l_B is not None:
                    out_l.append(to_host(l_B)[:, :n])
                produced += n
                if on_tokens is not None:
                    on_tokens(got[:B])
                if progress is not None:
                    progress("decode", produced, max_new_tokens)
                if np.all(to_host(d_B)):  # every row stopped: the chunk in flight holds only pads
                    launched, left = None, 0
            pending = launched
        decode_s = time.perf_counter() - t1
        tokens = np.concatenate(out_t, axis=1)[:B]
        tokens = np.concatenate([tokens, np.full((B, max_new_tokens - tokens.shape[1]), pad_id, np.int32)], 1)
        logits_np = None
        if return_logits:
            logits_np = np.concatenate(out_l, axis=1)[:B]
            missing = max_new_tokens - logits_np.shape[1]
            logits_np = np.concatenate([logits_np, np.zeros((B, missing, self.cfg.vocab_size), np.float32)], 1)
        jax.block_until_ready(cache)  # a chunk queued after every row stopped is finished too
        hit = np.isin(tokens, stops)
        lengths = np.where(hit.any(1), hit.argmax(1) + 1, max_new_tokens).astype(np.int32)
        return GenerateOutput(tokens=tokens.astype(np.int32), logits=logits_np, prompt_time_s=ttft,
                              decode_time_s=decode_s, lengths=lengths, prompt_tokens=Tt)

    def _check_length(self, rows: list[list[int]], max_new_tokens: int) -> None:
        """The longest prompt + max_new_tokens against max_position_embeddings and against the cache
        memory one rank can hold (ValueError with the figures), before anything is allocated."""
        total = max(len(r) for r in rows) + max_new_tokens
        mpe = getattr(self.cfg, "max_position_embeddings", None)
        if mpe is not None and total > mpe:
            raise ValueError(f"max_new_tokens: prompt + new tokens = {total} > max_position_embeddings {mpe}")
        slots = -(-total // CACHE_BUCKET) * CACHE_BUCKET
        need = self.cfg.cache_bytes_per_rank(-(-len(rows) // self.dp), slots, self.tp, self.dtype.itemsize,
                                             ring=kda_decode.RING)
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = local[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit is None:
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = limit - stats.get("bytes_in_use", 0)
        if need > free:
            raise ValueError(f"max_new_tokens: the decode cache for {len(rows)} rows x {slots} positions needs "
                             f"{need / 2**30:.1f} GiB per device, more than the {free / 2**30:.1f} GiB free")

    def _generate_step_by_step(self, rows: list[list[int]], max_new_tokens: int, return_logits: bool,
                               progress: Any) -> GenerateOutput:
        """Greedy, one token per dispatch: the prompt token by token through the decode step, then
        each new token waited for (the path before the prefill and the device loop)."""
        B, T = len(rows), max(len(r) for r in rows)
        toks, valid = self._left_pad(rows, T)
        Bp = toks.shape[0]
        cache = self.init_cache(Bp, -(-(T + max_new_tokens) // 64) * 64)
        t0 = time.perf_counter()
        for t in range(T):  # Model.step reads the lengths: at most one step is queued
            logits, nxt, cache = self.step(cache, toks[:, t], valid[:, t])
        nxt.block_until_ready()
        prompt_s, times = time.perf_counter() - t0, []
        out_tok, out_logits = [nxt], [logits]
        if progress is not None:
            progress("prompt", T, T)
            progress("decode", 1, max_new_tokens)
        ones = put_batch(np.arange(Bp) < B, self.mesh)
        for _ in range(max_new_tokens - 1):
            t0 = time.perf_counter()
            logits, nxt, cache = self._step(self.weights, cache, nxt, ones)
            nxt.block_until_ready()
            times.append(time.perf_counter() - t0)
            out_tok.append(nxt)
            out_logits.append(logits)
            if progress is not None:
                progress("decode", len(out_tok), max_new_tokens)
        tokens = np.stack([to_host(t)[:B] for t in out_tok], axis=1)
        logits_np = (np.stack([to_host(x)[:B].astype(np.float32) for x in out_logits], axis=1)
                     if return_logits else None)
        return GenerateOutput(tokens=tokens, logits=logits_np, step_times_s=times, prompt_time_s=prompt_s,
                              decode_time_s=sum(times), prompt_tokens=T)


class NonFiniteLogitsError(FloatingPointError):
    """generate met logits that are not finite (NaN or Inf): garbage in the weights or the inputs."""


def _raise_if_not_finite(bad_B: np.ndarray, where: str) -> None:
    if np.any(bad_B):
        raise NonFiniteLogitsError(
            f"generate: the logits of row(s) {np.flatnonzero(bad_B).tolist()} at {where} are not finite (NaN/Inf); "
            "the weights or inputs hold NaN/Inf (jaxk3.load_model(..., check_finite=True) names a bad tensor)")


def auto_prefill_chunk(cfg: KimiK3Config, rows: int, prompt_len: int, device_kind: str = "cpu",
                       dtype_bytes: int = 2, tp: int = 1) -> int:
    """The prefill chunk (prompt tokens per row per dispatch) that `Model.generate` and `Model.score` use
    when none is given: the power of two in [DEFAULT_PREFILL_CHUNK, MAX_PREFILL_TOKENS / rows] that
    minimises the prefill's estimated time, Σ over its chunks of max(weight bytes, FLOPs / f), with f
    the device's FLOP per byte (GPU_FLOP_PER_BYTE): each chunk reads every weight once (a chunk's
    tokens touch nearly all experts) and multiplies its tokens by the active ones.  Small chunks
    re-read the weights per chunk.  Past the balance point the estimate is flat, and ties go to the
    larger chunk: measured on an H200 (48B, 4K prompt; docs/PERF.md) larger chunks were faster still
    (B 1: 2048 0.246 s, 4096 0.223 s; B 8: 512 1.540 s, 1024 1.446 s; the kernels re-read expert
    weights per row block, and each dispatch has fixed costs), while the padding of a last chunk
    counts against it.  Memory bounds it too: MAX_PREFILL_TOKENS per dispatch, and MLA's scores over
    the prompt (MAX_PREFILL_SCORE_BYTES at `tp` ranks), so long prompts take shorter chunks.  On a CPU:
    DEFAULT_PREFILL_CHUNK (few FLOPs per byte: the balance lies below it)."""
    if device_kind == "cpu":
        return DEFAULT_PREFILL_CHUNK
    f = next((v for k, v in GPU_FLOP_PER_BYTE.items() if k in device_kind), DEFAULT_GPU_FLOP_PER_BYTE)
    tree = abstract_weights(cfg, 1)
    tok, _ = params.matmul_elements(tree, expert_fraction=cfg.num_experts_per_token / cfg.num_experts)
    weight_bytes = params.declared_bytes(tree, dtype_bytes, skip=("embed", "lm_head"))
    best, best_layout, best_cost = DEFAULT_PREFILL_CHUNK, None, None
    c = DEFAULT_PREFILL_CHUNK
    heads = cfg.num_attention_heads / tp if cfg.mla_layers else 0
    while c * rows <= max(MAX_PREFILL_TOKENS, DEFAULT_PREFILL_CHUNK * rows):
        layout = prefill_layout(prompt_len, c)
        padded, per = layout
        if c > DEFAULT_PREFILL_CHUNK and rows * per * heads * padded * 4 > MAX_PREFILL_SCORE_BYTES:
            break
        cost = (padded // per) * max(weight_bytes, 2 * tok * rows * per / f)
        if layout != best_layout and (best_cost is None or cost <= best_cost * (1 + 1e-9)):
            best, best_layout, best_cost = c, layout, cost
        if per < c:  # the whole prompt fits one chunk: larger ones are the same dispatch
            break
        c *= 2
    return best


@functools.partial(jax.jit, static_argnums=(2, 3))
def _rows_to_start(chunks: tuple, lens_B: jax.Array, T: int, sharding: NamedSharding) -> jax.Array:
    """[B, T, V] (placed by `sharding`) from the prefill chunks' logits in its padded layout, [Bp, chunk, V] each (row
    i's tokens at [Tt - len_i, Tt) of their concatenation): row i's positions at [0, len_i), NaN after them (as `score`
    places them on the host).  The concatenation fuses into the gather: two copies of the logits on the devices at
    most, the chunks' and this.  Compiled once per (Bp, Tt, T): a gather."""
    x = jnp.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]
    Tt = x.shape[1]
    t_T = jnp.arange(T)
    src_BT = jnp.clip(Tt - lens_B[:, None] + t_T[None, :], 0, Tt - 1)
    vals = jnp.take_along_axis(x[:lens_B.shape[0]], src_BT[..., None], axis=1)
    out = jnp.where((t_T[None, :] < lens_B[:, None])[..., None], vals, jnp.nan)
    return jax.lax.with_sharding_constraint(out, sharding)


def _by_rows(pool: ThreadPoolExecutor, threads: int, n: int, fn, min_rows: int = 16) -> None:
    """fn(start, stop) over [0, n) in up to `threads` parts of at least `min_rows` rows, run by the pool (numpy
    releases the GIL in fills and copies)."""
    parts = max(1, min(threads, n // min_rows))
    step = -(-n // parts)
    list(pool.map(lambda j: fn(j * step, (j + 1) * step), range(parts)))


def _fill(pool: ThreadPoolExecutor, threads: int, dst: np.ndarray, value: float) -> None:
    """dst[...] = value, split along the first axis over `threads` of the pool."""
    _by_rows(pool, threads, dst.shape[0], lambda a, b: dst[a:b].fill(value))


def _copy(pool: ThreadPoolExecutor, threads: int, dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, split along the first axis over `threads` of the pool."""
    _by_rows(pool, threads, dst.shape[0], lambda a, b: np.copyto(dst[a:b], src[a:b]))


def _check_chunk(chunk: Any) -> int:
    if chunk is None:
        return DEFAULT_PREFILL_CHUNK
    if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 64 or chunk % 64:
        raise ValueError(f"prefill_chunk: must be a positive multiple of 64, got {chunk!r}")
    return int(chunk)


def prefill_layout(prompt_len: int, prefill_chunk: int | None = None) -> tuple[int, int]:
    """(the padded prompt length, the prompt tokens per row of one prefill dispatch) for a longest
    prompt of `prompt_len` tokens: a multiple of the prefill chunk; for prompts shorter than a chunk
    a multiple of 64 · max(1, chunk // 512) (64 up to 512-token chunks, 512 for 4096: at most 8 padded
    lengths, so 8 compiles, per chunk size past 512), at most the chunk; or the prompt itself up to 64
    tokens (the KDA chunk).  The second figure is what the prefill's collectives carry per row
    (jaxk3 generate checks it against the FFI's row limit)."""
    chunk = _check_chunk(prefill_chunk)
    T = prompt_len
    if T > chunk:
        Tt = -(-T // chunk) * chunk
    elif T <= 64:
        Tt = T
    else:
        step = 64 * max(1, chunk // 512)
        Tt = min(chunk, -(-T // step) * step)
    return Tt, min(chunk, Tt)


def _check_stop_ids(stop_ids: Any, cfg: KimiK3Config) -> tuple[int, ...]:
    """The ids that end a row: `stop_ids`, or by default every one of the config's eos_token_ids."""
    if stop_ids is None:
        return tuple(int(i) for i in cfg.eos_token_ids)
    try:
        ids = tuple(int(i) for i in stop_ids)
    except (TypeError, ValueError):
        raise TypeError(f"stop_ids: need an iterable of token ids, got {stop_ids!r}") from None
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_ids: ids outside [0, {cfg.vocab_size}): {bad}")
    return ids


def init_random_model(cfg: KimiK3Config, seed: int = 0, mesh: Mesh | None = None, tp: int | None = None,
                      dtype: Any = "bfloat16", gather: str = "auto", shard_latent: bool = True,
                      psum: str = "auto", kernels: str = "auto", layout: str = "auto") -> Model:
    """A model with random weights (`random_hf_weights(cfg, seed)`), sharded over `mesh` (or the first
    `tp` devices); routed experts as `cfg.experts_format` says (random MXFP4 bytes for "mxfp4")."""
    check_impl("gather", gather), check_impl("psum", psum), check_kernels(kernels)
    m = make_mesh(mesh, tp)
    cfg.validate_tp(m.shape[TP_AXIS], shard_latent=shard_latent)
    return Model.from_weights(cfg, random_hf_weights(cfg, seed), mesh=m, dtype=dtype, gather=gather,
                              shard_latent=shard_latent, psum=psum, kernels=kernels, layout=layout)


def load_model(path: str | os.PathLike, mesh=None, tp: int | None = None, dtype: Any = "bfloat16",
               gather: str = "auto", shard_latent: bool = True,
               progress: Callable[[int, int], None] | None = None, psum: str = "auto", check_finite: bool = True,
               experts: str = "auto", kernels: str = "auto", layout: str = "auto"):
    """A sharded `Model` from a K3 / Kimi-Linear safetensors directory (docs/CHECKPOINTS.md).

    `experts`: "auto" (MXFP4 experts stay packed on the device, dense ones stay dense), "mxfp4" (the
    checkpoint's experts must be MXFP4) or "dense" (MXFP4 experts dequantised to `dtype` at load).
    `kernels`: device kernels "auto" (where the platform has them and the shapes fit), "off", "on".
    `layout`: "auto" (the serving layout on GPUs, the checkpoint's on CPUs), "serving", "checkpoint".

    `progress(done_bytes, total_bytes)` is called after each weight is placed.  Raises
    `CheckpointError` (subclasses named after the problem) before reading any tensor data, except
    `NonFiniteTensorError` (a NaN/Inf, or an MXFP4 scale byte of 255), raised as the tensor is read
    (`check_finite=False` skips that check; docs/CHECKPOINTS.md has its cost).
    """
    check_impl("gather", gather), check_impl("psum", psum), check_kernels(kernels)
    dt = resolve_dtype(dtype)
    checkpoint.check_experts(experts)
    mesh = make_mesh(mesh, tp)
    resolve_layout(layout, mesh.devices.flat[0].platform)
    cfg, weights = checkpoint.load_weights(path, mesh, dt, shard_latent, progress, check_finite, experts)
    return Model(cfg, weights, mesh, dt, gather, shard_latent, psum, kernels, layout, donate_weights=True)
