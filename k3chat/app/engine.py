"""Opening what the app chats with: a model directory (or the built-in demo model) and its
tokenizer. Runs on a worker thread; ``progress`` receives one line per step for the screen.

The default factory goes through ``k3engine.budgeted.open_budgeted`` exactly like
``k3chat run``: the memory plan is made before anything loads and refused with its numbers.
Tests pass their own factory (an already open model, a scripted sampler).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3chat import paths
from k3chat.runtime import Failure, open_model
from k3chat.settings import Settings

Progress = Callable[[str], None]

# The model could not be opened: runtime.Failure, whose message is for the user and whose
# code is the exit code (2 when the command line or the checkpoint is at fault).
EngineOpenError = Failure


@dataclass
class Engine:
    """An open model and what the app shows about it."""

    model: Any
    tokenizer: Any
    model_dir: Path
    name: str
    plan: Any = None  # k3engine.planner.Plan, None when every weight is resident without a plan
    memory: str = "all"
    owns_model: bool = True  # close the model when the app closes
    context: int | None = None  # Conversation(context=...): None means the model's own limit
    conversation_options: dict[str, Any] = field(default_factory=dict)  # more Conversation kwargs
    # Conversation's signature; None is Conversation itself. The remote backend sets both below.
    conversation_factory: Callable[..., Any] | None = None
    remote: str | None = None  # the server's API address when the model is remote

    def close(self) -> None:
        if self.owns_model:
            try:
                self.model.close()
            except Exception:
                pass


EngineFactory = Callable[[Path, Settings, Progress], Engine]


def plan_summary(engine: Engine) -> str:
    """One short line about the memory plan, for the status bar."""
    if engine.remote is not None:
        return f"remote: {engine.remote}"  # said plainly: nothing is computed on this machine
    plan = engine.plan
    if plan is None:
        return "all resident"
    from k3engine.sizes import format_bytes

    if plan.trunk_resident:
        trunk = "trunk resident"
    else:
        trunk = f"trunk {len(plan.pinned_layers)} pinned/{len(plan.streamed_layers)} streamed"
    budget = format_bytes(plan.budget).replace(".00 ", " ")
    return f"{budget}: {trunk}, {plan.expert_slots} expert slots"


def open_engine(model_dir: Path, settings: Settings, progress: Progress, *, memory: str | None = None,
                threads: int | None = None, context: int | None = None) -> Engine:
    """Plan and open ``model_dir`` under the memory budget, exactly as `k3chat run` does
    (runtime.open_model); a failure is a runtime.Failure with the reason and the exit code."""
    from k3engine.planner import DEFAULT_CONTEXT

    memory = memory or settings.memory
    opened = open_model(model_dir, memory=memory, context=context or DEFAULT_CONTEXT, threads=threads,
                        progress=progress, speculative=settings.speculative)
    # N_ctx: the context the memory plan was made for (the Conversation must not outgrow it)
    planned = opened.context if opened.plan is not None else context
    return Engine(model=opened.model, tokenizer=opened.tokenizer, model_dir=Path(model_dir), name=Path(model_dir).name,
                  plan=opened.plan, memory=memory, context=planned)


def open_remote_engine(endpoint: Any, progress: Progress) -> Engine:
    """A remote model (k3chat.remote) behind the Engine the app knows: the client in place of
    the model, RemoteConversation in place of Conversation; a failure is a runtime.Failure."""
    from k3chat.remote import RemoteClient, RemoteError, remote_conversation_factory, resolve_model

    progress(f"Connecting to {endpoint.url}")
    try:
        client = RemoteClient(endpoint)
    except RemoteError as exc:
        raise Failure(exc.message, exc.code) from None
    try:
        model = resolve_model(client)
    except RemoteError as exc:
        client.close()
        raise Failure(exc.message, exc.code) from None
    return Engine(model=client, tokenizer=None, model_dir=Path(model), name=f"{model} (remote)", memory="remote",
                  conversation_factory=remote_conversation_factory(client, model), remote=endpoint.url)
