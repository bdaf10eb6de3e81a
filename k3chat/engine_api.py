"""The seam between the chat core and an engine: what Conversation (and the front-ends) call.

``k3engine.model.Model`` and its ``Session`` satisfy these Protocols; tests substitute
scripted models that do too. Keeping the seam typed (rather than ``Any``) is what lets a
second engine, or a remote one, stand behind the same conversation code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineConfig", "EngineSession", "VerifyingSession", "EngineModel", "CancelToken"]


class EngineConfig(Protocol):
    @property
    def vocab(self) -> int: ...


class CancelToken(Protocol):
    """Set from any thread (or a signal handler) to stop the step in flight."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...


@runtime_checkable
class EngineSession(Protocol):
    """One sequence's engine state: positions fed so far, snapshots, export and import."""

    @property
    def length(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def tainted(self) -> bool: ...

    def reset(self) -> None: ...

    def feed(self, ids: Sequence[int], *, cancel: Any = None) -> Any: ...  # -> float32 logits

    def snapshot(self) -> int: ...

    def restore(self, snap_id: int) -> None: ...

    def drop_snapshot(self, snap_id: int) -> None: ...

    def export_state(self) -> bytes | bytearray: ...

    def import_state(self, data: bytes) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class VerifyingSession(EngineSession, Protocol):
    """A session that can verify drafted tokens in one pass (speculative decoding): ``verify``
    returns every position's logits without advancing; ``accept(keep)`` then advances by the
    first ``keep`` of them, exactly as feeding them would."""

    def verify(self, ids: Sequence[int], *, cancel: Any = None) -> Any: ...  # -> float32 [n, V]

    def accept(self, keep: int) -> None: ...


@runtime_checkable
class EngineModel(Protocol):
    """An open model: its config, a session factory, counters, and close. (The engine's Model
    also has ``dir``, the checkpoint directory, which Conversation reads when present.)"""

    @property
    def config(self) -> EngineConfig: ...

    def session(self, max_positions: int) -> EngineSession: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...
