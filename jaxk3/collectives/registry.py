"""The extension registry: ``jaxk3._ffi`` imported once, its targets registered with XLA once per
platform, and one warning (not one per call) when either cannot be done."""
from __future__ import annotations

import threading
import warnings
from typing import Any

import jax

from jaxk3.collectives import settings

# jax platform name -> the platform name FFI targets are registered under.
FFI_PLATFORM = {"cpu": "cpu", "gpu": "CUDA", "cuda": "CUDA"}


class _State:
    """What has been loaded and registered so far (tests replace it to start over)."""

    def __init__(self) -> None:
        self.loaded = False
        self.ext: Any = None
        self.error: str | None = None
        self.registered: set[str] = set()
        self.warned: set[str] = set()


_lock = threading.RLock()
_state = _State()


def warn_once(key: str, msg: str) -> None:
    with _lock:
        if key in _state.warned:
            return
        _state.warned.add(key)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def extension():
    """The compiled ``jaxk3._ffi`` module, or None (with the reason in :func:`extension_error`).

    Loading it hands it the settings (settings.push): a bad ``JAXK3_GATHER_TIMEOUT_S`` is a
    ``ValueError`` here, not a failed import."""
    with _lock:
        if not _state.loaded:
            settings.timeout_s()  # the user's error, raised before anything is loaded
            try:
                from jaxk3 import _ffi  # type: ignore[attr-defined]
            except Exception as e:  # ImportError, or an ABI problem
                _state.error = f"the jaxk3._ffi extension failed to import ({type(e).__name__}: {e})"
            else:
                settings.push(_ffi, jax.process_index())
                _state.ext = _ffi
            _state.loaded = True
        return _state.ext


def extension_error() -> str | None:
    extension()
    return _state.error


def targets(platform: str) -> dict[str, Any]:
    """Target name -> handler capsule, for an FFI platform name (``cpu`` or ``CUDA``)."""
    ext = extension()
    if ext is None:
        return {}
    if platform == "cpu":
        return dict(ext.cpu_targets())
    if platform == "CUDA":
        return dict(ext.cuda_targets())
    return {}


def types(platform: str) -> dict[str, Any]:
    """Type name -> {"type_id", "type_info"} capsules: the FFI state types of `platform`."""
    ext = extension()
    if ext is None or platform != "cpu":
        return {}
    return dict(ext.cpu_types())


def register(platform: str) -> bool:
    """Registers every type and target of `platform` once; False when this build has no handler
    for it."""
    with _lock:
        if platform in _state.registered:
            return True
        found = targets(platform)
        if not found:
            return False
        for name, registration in types(platform).items():
            jax.ffi.register_ffi_type(name, registration, platform=platform)
        for name, capsule in found.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _state.registered.add(platform)
        return True


def has_target(platform: str, name: str) -> bool:
    """Whether `name` is built and registered for `platform`."""
    return register(platform) and name in targets(platform)
