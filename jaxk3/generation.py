"""Generation on the device: chunked prefill, sampling, and a decode loop that never waits on the host.

    prefill   the prompt in chunks of T tokens per row, one dispatch each (KDA in chunked form,
              causal MLA over the cached prefix, MoE as grouped GEMMs); the last chunk also picks
              the first new token
    decode    N new tokens per dispatch: the decode step inside `lax.fori_loop`, the sampled token
              fed back on the device, rows that met a stop id frozen (their caches untouched, their
              remaining tokens `pad_id`)

Sampling (`Sampling`): greedy when temperature is 0; else logits / temperature, then top-k and
top-p (nucleus) filtering, then a categorical draw keyed by (seed, the token's position in the
output), so a run is reproducible from its seed whatever the chunking.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxk3.model import compiler_options, local_forward


F32 = jnp.float32

# The builders below are cached on (config, options, mesh, ...): models of one config on one mesh
# share their compiled prefill and decode loop.


SEED_LIMIT = 1 << 64  # seeds are 64-bit: 0 <= seed < 2**64, never wrapped
# The smallest float32 temperature that logits are divided by: below it (a subnormal, which XLA may
# flush to zero, or 0 after the cast) sampling is greedy, which is what such a temperature means.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.  temperature 0 (or below MIN_TEMPERATURE, the smallest normal
    float32): greedy (argmax); top_k 0: no top-k limit; top_p 1.0: no nucleus limit; seed: an int in
    [0, 2**64), every bit of it keys the draws."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)) or \
                not (t >= 0 and np.isfinite(t)):
            raise ValueError(f"temperature: must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"top_k: must be an int >= 0 (0: off), got {k!r}")
        p = self.top_p
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)) or \
                not 0 < p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {p!r}")
        seed = self.seed
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or \
                not 0 <= int(seed) < SEED_LIMIT:
            raise ValueError(f"seed: must be an int in [0, 2**64) (64 bits, never wrapped), got {seed!r}")
        # plain Python values: the dataclass is a static argument of jitted functions (hashed, compared)
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "seed", int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def key(self) -> jax.Array:
        """The threefry key of the 64-bit seed: words [seed >> 32, seed & 0xFFFFFFFF], which is
        `jax.random.key(seed)` for seeds below 2**32 (so those draws are what they always were)."""
        words = np.array([self.seed >> 32, self.seed & 0xFFFFFFFF], np.uint32)
        return jax.random.wrap_key_data(jnp.asarray(words), impl="threefry2x32")


def sample(logits_BV: jax.Array, position: jax.Array, s: Sampling) -> jax.Array:
    """The next token of each row, int32 [B]; `position` (a scalar) keys the draw.  The logits are
    shifted by their row maximum before the division by the temperature, so that a tiny temperature
    gives finite logits (the best at 0, the rest very negative or -inf) and samples the best token,
    never a row of infinities."""
    if s.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    lg = logits_BV.astype(F32)
    lg = (lg - jnp.max(lg, axis=-1, keepdims=True)) / jnp.float32(s.temperature)
    if s.top_k:
        kth = lax.top_k(lg, min(s.top_k, lg.shape[-1]))[0][:, -1:]
        lg = jnp.where(lg < kth, -jnp.inf, lg)
    if s.top_p < 1.0:
        srt = jnp.sort(lg, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        keep = before < s.top_p  # always keeps the first
        threshold = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        lg = jnp.where(lg < threshold, -jnp.inf, lg)
    key = jax.random.fold_in(s.key(), position)
    return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=64)
def build_prefill(cfg, opt, mesh: Mesh, all_logits: bool, sampling: Sampling | None = None):
    """jit(fn)(weights, cache, tokens_BT, valid_BT, position) -> (logits, first_B or None, finite_B, cache),
    the cache donated.  logits: [B, T, vocab] (`all_logits`) or the last position's [B, vocab]; with a
    `sampling`, first_B is the token sampled from the last position (keyed by `position`); finite_B:
    whether the last position's logits are all finite."""
    local, w_sh, c_sh, b_sh = local_forward(cfg, opt, mesh, all_logits)

    def run(weights, cache, tokens_BT, valid_BT, position):
        logits, cache = local(weights, cache, tokens_BT, valid_BT)
        last = logits[:, -1] if all_logits else logits
        first = None if sampling is None else sample(last, position, sampling)
        return logits, first, jnp.all(jnp.isfinite(last), axis=-1), cache

    return jax.jit(run, donate_argnames=("cache",), in_shardings=(w_sh, c_sh, b_sh, b_sh, None),
                   out_shardings=(b_sh, b_sh if sampling is not None else None, b_sh, c_sh),
                   compiler_options=compiler_options())


@functools.lru_cache(maxsize=64)
def build_decode_loop(cfg, opt, mesh: Mesh, steps: int, sampling: Sampling, stop_ids: tuple[int, ...],
                      pad_id: int, return_logits: bool):
    """jit(fn)(weights, cache, tok_B, done_B, position) -> (tokens [B, steps], logits [B, steps, V] or
    None, cache, tok_B, done_B, bad_B), the cache donated.  Each step feeds `tok_B` (the last token
    of every row), samples the next one (keyed by position + i), and freezes rows that produced a
    stop id: their caches stay as they were and their later tokens are `pad_id`.  bad_B: a running
    row met logits that were not all finite (checked on the device, read once per call)."""
    local, w_sh, c_sh, b_sh = local_forward(cfg, opt, mesh)
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def run(weights, cache, tok, done, position):
        B = tok.shape[0]
        out_t = jnp.full((B, steps), pad_id, jnp.int32)
        out_l = jnp.zeros((B, steps, cfg.vocab_size), F32) if return_logits else None

        def body(i, carry):
            cache, tok, done, bad, out_t, out_l = carry
            logits, cache = local(weights, cache, tok, ~done)
            bad = bad | (~done & ~jnp.all(jnp.isfinite(logits), axis=-1))
            nxt = jnp.where(done, pad_id, sample(logits, position + i, sampling))
            out_t = out_t.at[:, i].set(nxt)
            if out_l is not None:
                out_l = out_l.at[:, i].set(logits)
            done = done | jnp.isin(nxt, stops)
            return cache, jnp.where(done, tok, nxt), done, bad, out_t, out_l

        cache, tok, done, bad, out_t, out_l = lax.fori_loop(
            0, steps, body, (cache, tok, done, jnp.zeros_like(done), out_t, out_l))
        return out_t, out_l, cache, tok, done, bad

    return jax.jit(run, donate_argnames=("cache",), in_shardings=(w_sh, c_sh, b_sh, b_sh, None),
                   out_shardings=(b_sh, b_sh if return_logits else None, c_sh, b_sh, b_sh, b_sh),
                   compiler_options=compiler_options())
