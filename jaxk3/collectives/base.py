"""The types every collectives module shares: the static decision (:class:`Plan`) and the error
``impl="ffi"`` raises when the fast path does not apply."""
from __future__ import annotations

import dataclasses


class GatherUnavailableError(RuntimeError):
    """``impl="ffi"`` was asked for but the fast path does not apply; the message says why."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static decision for one collective: ``path`` is ``ffi``, ``lax`` or ``identity``."""

    path: str
    reason: str
    target: str | None = None
    group_size: int = 1
    platform: str | None = None
    table: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f" via {self.target} on {self.platform}" if self.path == "ffi" else ""
        return f"{self.path}{where}: {self.reason}"
