"""Every environment variable of the collectives, read and checked here and nowhere else.

=========================  ======================================================  ========
variable                   meaning                                                 default
=========================  ======================================================  ========
``JAXK3_GATHER``           default ``impl``: ``auto``, ``ffi`` or ``lax``          ``auto``
``JAXK3_GATHER_MAX_ROWS``  rows (all dims but the last) above which it falls back  ``64``
``JAXK3_GATHER_MAX_BYTES`` payload bytes per rank above which it falls back        CUDA ``1048576``, CPU ``32768``
``JAXK3_GATHER_TIMEOUT_S`` seconds a rank waits for its peers before failing       ``60``
``JAXK3_DEBUG``            non-empty: the C++ side prints each timeout it detects  unset
=========================  ======================================================  ========

``impl``, rows and bytes are read each time a collective is planned, so they can change between
traces.  The timeout is read once, when the extension loads (:func:`push` hands it and the
other process-wide values to C++, which never reads the environment); ``set_timeout`` changes it
later.  A value that does not parse, or is out of range, is a ``ValueError`` naming the variable.
"""
from __future__ import annotations

import math
import os

ENV_IMPL = "JAXK3_GATHER"
ENV_MAX_ROWS = "JAXK3_GATHER_MAX_ROWS"
ENV_MAX_BYTES = "JAXK3_GATHER_MAX_BYTES"
ENV_TIMEOUT = "JAXK3_GATHER_TIMEOUT_S"
ENV_DEBUG = "JAXK3_DEBUG"

IMPLS = ("auto", "ffi", "lax")

DEFAULT_MAX_ROWS = 64
# Above this many bytes per rank the CPU handler (one thread copies all n x n payloads) loses
# to XLA's all-gather at 8 devices (docs/PERF.md: 16 KB 5x faster, 64 KB 0.83x).
DEFAULT_MAX_BYTES = {"cpu": 32 << 10, "CUDA": 1 << 20}
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: anything longer is a typo, not a timeout
# A CUDA communicator's receive slots hold at least this many bytes per rank.
CUDA_MIN_CAPACITY = 1 << 20


def _raw(name: str) -> str | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def _parsed(name: str, parse, kind: str):
    """The variable's value through `parse`, None when unset; a ValueError naming it otherwise."""
    raw = _raw(name)
    if raw is None:
        return None
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {kind}") from None


def _nonnegative_int(name: str, default: int) -> int:
    value = _parsed(name, int, "an integer")
    if value is None:
        return default
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


def default_impl() -> str:
    """``JAXK3_GATHER``: what ``impl="auto"`` means."""
    impl = (_raw(ENV_IMPL) or "auto").lower()
    if impl not in IMPLS:
        raise ValueError(f"{ENV_IMPL}={impl!r}: expected one of {IMPLS}")
    return impl


def resolve_impl(impl: str) -> str:
    """``auto`` defers to ``JAXK3_GATHER``; ``ffi``/``lax`` are explicit."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    return default_impl() if impl == "auto" else impl


def max_rows() -> int:
    return _nonnegative_int(ENV_MAX_ROWS, DEFAULT_MAX_ROWS)


def max_bytes(platform: str = "CUDA") -> int:
    return _nonnegative_int(ENV_MAX_BYTES, DEFAULT_MAX_BYTES.get(platform, 1 << 20))


def timeout_s() -> float:
    """``JAXK3_GATHER_TIMEOUT_S``: a finite number of seconds in (0, a week]."""
    seconds = _parsed(ENV_TIMEOUT, float, "a number of seconds")
    if seconds is None:
        return DEFAULT_TIMEOUT_S
    return check_timeout(seconds, f"{ENV_TIMEOUT}={seconds!r}")


def check_timeout(seconds: float, what: str = "timeout") -> float:
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise ValueError(f"{what} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    return float(seconds)


def cuda_capacity() -> int:
    """Receive-slot bytes per rank of a CUDA communicator: the byte cap, at least 1 MiB."""
    return max(CUDA_MIN_CAPACITY, max_bytes("CUDA"))


def verbose() -> bool:
    return _raw(ENV_DEBUG) is not None


def push(ext, process_index: int) -> None:
    """Hands the process-wide values to the C++ side (which reads no environment)."""
    timeout = timeout_s()  # checked before anything is set
    capacity = cuda_capacity()
    ext.set_process_index(int(process_index))
    ext.set_timeout_ms(int(round(timeout * 1000)))
    ext.set_cuda_capacity_bytes(capacity)
    ext.set_verbose(verbose())
