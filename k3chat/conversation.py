"""The conversation loop that the CLI and the app both drive (spec k3-chat.md 5, design 2.5/3).

One turn: render the history plus the new message -> encode -> refuse an overflow before the
history changes -> commit the user record -> reuse the longest fed prefix (live state, a
turn-boundary snapshot, or the session's state file) -> prefill only the rest -> sample and
stream -> parse (strictly, else leniently and marked interrupted) -> append -> save the state.

Invariants this module keeps:

- ``_fed`` mirrors the ids the engine session holds (spec 5.3 F), recorded where they are
  fed. A sampled end id is never fed, and neither is the last id sampled when the turn stops
  for any other reason, so F stays exact and the state reusable.
- Reuse is all or nothing per candidate: a state is reused only if it is untainted and every
  id it holds begins the new prompt (``0 < |F| < |P|``). Otherwise the next shorter
  candidate is tried, down to a full prefill.
- The history is changed only after the prompt is known to fit, and everything generated is
  appended, interrupted or not.

No Textual (or any UI) import here: the app runs this on a worker thread and receives events.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from k3chat import paths, statefile
from k3chat.attachments import Attachment, model_message
from k3chat.engine_api import EngineModel, EngineSession, VerifyingSession
from k3chat.events import (
    AnswerToken,
    Event,
    EventHandler,
    Notice,
    PhaseChanged,
    Prefill,
    ReasoningToken,
    Stats,
    TurnDone,
    ignore,
)
from k3chat.history import STOPS, HistoryStore
from k3chat.progress import PrefillMeter
from k3chat.sampler import Sampler, SamplerSettings
from k3chat.speculative import Speculator
from k3chat.template import Grammar, MalformedTurn, ParsedTurn, StreamParser, encode, render
from k3chat.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # G, spec 5.2
# The memory planner budgets exactly this many turn snapshots (k3engine.planner.DEFAULT_SNAPSHOTS,
# each a full state export at the context): keeping more would outgrow the plan.
DEFAULT_MAX_SNAPSHOTS = 1
# Positions kept free beyond the spec's len(P) + G + 1, so that an answer cut at the limit can
# still be closed (BOUNDARY + CLOSURE + end id) and re-fed by the state sync: the slack covers
# text whose canonical encoding is a little longer than the sampled ids.
CLOSE_SLACK = 16
STATE_SUFFIX = ".k3state"
# Bumped when the engine's exported state layout changes (native/k3_state.c KS_VERSION):
# part of the fingerprint, so an old state file is refused by reason rather than by luck.
ENGINE_STATE_LAYOUT = b"k3-engine-state:K3S1:v1"
# Prompt tokens per engine call while prefilling when every weight is held (trunk resident,
# every routed expert fits the cache): a piece smaller than the engine's chunk then reads
# nothing twice, and a long prompt reports progress and can stop this often. Otherwise a
# piece is the engine's own chunk, so each distinct expert is still read once per chunk.
RESIDENT_PIECE = 64


# --------------------------------------------------------------------------- errors


class ConversationError(Exception):
    """A turn could not start; the history was not changed."""


class ContextOverflow(ConversationError):
    """The prompt plus the generation limit does not fit in the context (spec 5.2 step 3)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context: int, reserve: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context = context
        self.reserve = reserve
        extra = f" + {reserve} to close a cut answer" if reserve else ""
        super().__init__(
            f"the conversation would overflow the context: {prompt_tokens} prompt tokens + "
            f"{max_tokens} for the answer + 1{extra} > {context} positions; the history was not changed"
        )


class _PrefillStopped(Exception):
    """cancel() seen between two prefill pieces: the state holds every piece fed so far."""


class TurnFailed(ConversationError):
    """The engine or the sampler failed during a turn. What was generated before the failure
    is in ``result`` and was saved (marked interrupted) unless ``result.saved`` is False."""

    def __init__(self, result: TurnResult, cause: BaseException) -> None:
        self.result = result
        self.cause = cause
        saved = "the partial answer was saved, marked interrupted" if result.saved else "nothing was saved"
        super().__init__(f"{cause} ({saved})")


# --------------------------------------------------------------------------- results


@dataclass
class TurnResult:
    session_id: str
    turn: int  # the sampler's turn number (spec 4)
    record: dict[str, Any]  # the assistant record as stored
    reasoning: str | None  # None when thinking was off
    answer: str
    interrupted: bool
    stop: str  # "end", "limit", "cancelled", "malformed", "error"
    message: str | None  # why the turn is interrupted, for the user (never persisted)
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    reuse_source: str | None  # "live", "snapshot", "state_file" or None (full prefill)
    reuse_note: str | None  # why a saved state was not used, if one was refused
    generated_ids: list[int]
    prefill_seconds: float
    decode_seconds: float
    seed: int | None  # None when greedy
    greedy: bool
    saved: bool = True
    sync_tokens: int = 0  # fed after the turn to line the state up with the stored text
    state_saved: bool = False
    engine: dict[str, int] = field(default_factory=dict)
    # Stopped while the prompt was read: no answer was stored, the user message waits for
    # respond(); prefilled_tokens says how much of it was read this time.
    pending: bool = False
    draft_proposed: int = 0  # speculative decoding: drafted tokens verified
    draft_accepted: int = 0  # ... of which the sampler produced the same token

    @property
    def draft_acceptance(self) -> float | None:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else None

    @property
    def generated_tokens(self) -> int:
        return len(self.generated_ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session_id,
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "reuse_source": self.reuse_source,
            "reuse_note": self.reuse_note,
            "generated_tokens": self.generated_tokens,
            "generated_ids": list(self.generated_ids),
            "reasoning": self.reasoning,
            "answer": self.answer,
            "interrupted": self.interrupted,
            "stop": self.stop,
            "message": self.message,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "greedy": self.greedy,
            "seed": self.seed,
            "saved": self.saved,
            "sync_tokens": self.sync_tokens,
            "state_saved": self.state_saved,
            "pending": self.pending,
            "draft_proposed": self.draft_proposed,
            "draft_accepted": self.draft_accepted,
            "stats": dict(self.engine),
        }


# --------------------------------------------------------------------------- model identity


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 100 << 20))


def model_fingerprint_for(model_dir: str | Path) -> str:
    """The identity a state file must match: config.json and the tensor index (or the single
    file's header) as raw bytes, plus each shard's name, size and mtime and the engine's state
    layout. A touched or replaced shard therefore costs a re-prefill, never a wrong state."""
    d = Path(model_dir)
    config = (d / "config.json").read_bytes()
    index_path = d / "model.safetensors.index.json"
    if index_path.is_file():
        index = index_path.read_bytes()
    elif (d / "model.safetensors").is_file():
        index = _safetensors_header(d / "model.safetensors")
    else:
        index = b""
    extra = [ENGINE_STATE_LAYOUT]
    for shard in sorted(d.glob("*.safetensors")):
        st = shard.stat()
        extra.append(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return statefile.model_fingerprint(config, index, extra=b"\n".join(extra))


def model_max_positions(model_dir: str | Path) -> int | None:
    """``max_position_embeddings`` from config.json (text_config first), if it states one."""
    try:
        doc = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for scope in (doc.get("text_config"), doc):
        if isinstance(scope, dict):
            value = scope.get("max_position_embeddings")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def state_path(session_id: str) -> Path:
    return paths.state_dir() / "sessions" / f"{session_id}{STATE_SUFFIX}"


def delete_state(session_id: str) -> bool:
    """Remove a session's state file (it holds the conversation in another form), and any
    temp copy a crashed save of it left behind."""
    path = state_path(session_id)
    paths.sweep_temps(path.parent, target=path.name, any_pid=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def sweep_state_temps() -> list[Path]:
    """Remove state-file temp copies left by processes that died while saving."""
    return paths.sweep_temps(paths.state_dir() / "sessions")


def engine_prefill_piece(model: EngineModel) -> int | None:
    """Prompt tokens per engine call while prefilling (see RESIDENT_PIECE); None: all at once
    (an engine that does not say its chunk)."""
    streaming = getattr(model, "streaming", None)  # k3engine's StreamOptions; not part of the seam
    chunk = getattr(streaming, "prefill_chunk", None)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        return None
    return min(chunk, RESIDENT_PIECE) if _holds_every_weight(model, streaming) else chunk


def _holds_every_weight(model: EngineModel, streaming: object) -> bool:
    if getattr(streaming, "trunk_stream", True):
        return False
    config = model.config
    moe_layers = getattr(config, "moe_layers", None)
    n_experts = getattr(config, "n_experts", None)
    if not isinstance(moe_layers, tuple) or not isinstance(n_experts, int):
        return False
    try:
        slots = int(model.stats().get("expert_slots", 0))
    except Exception:
        return False
    return slots >= len(moe_layers) * n_experts


def default_context(model_dir: str | Path | None) -> int:
    """The context a Conversation gets without ``context=``: the planner's default (what
    ``open_budgeted`` plans memory for), or the model's own limit if that is smaller."""
    from k3engine.planner import DEFAULT_CONTEXT

    limit = model_max_positions(model_dir) if model_dir is not None else None
    return min(DEFAULT_CONTEXT, limit) if limit else DEFAULT_CONTEXT


def stop_message(stop: str, generated: int) -> str | None:
    """What an interrupted turn says about why it ended (None for a finished one); made from
    the stored record too, so a redraw or a resume says the same."""
    if stop == "end":
        return None
    if stop == "limit":
        return (f"stopped at the {generated}-token limit before the model finished its answer; "
                "what it said was kept, marked interrupted")
    if stop == "cancelled":
        return "stopped on request; what the model said so far was kept, marked interrupted"
    if stop == "malformed":
        return "the model's answer is malformed; what it said was kept, marked interrupted"
    return "the turn failed; what the model said so far was kept, marked interrupted"


def user_record(text: str, attachments: Sequence[Attachment] = ()) -> dict[str, Any]:
    """A new user record: what was typed, and each attachment as the history keeps it."""
    record: dict[str, Any] = {"role": "user", "content": text}
    if attachments:
        record["attachments"] = [a.to_record() for a in attachments]
    return record


def assistant_record(*, content: str, reasoning: str | None, stop: str, model: str | None, effort: str | None,
                     sampler: SamplerSettings, prompt: int, reused: int, generated: int) -> dict[str, Any]:
    """The fields every answer record has, local or remote: the text, why it stopped, how it was
    asked for and its token counts (``reasoning`` None: thinking was off). Callers add the rest."""
    thinking = reasoning is not None
    rec: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        rec["reasoning_content"] = reasoning
    if stop != "end":
        rec["interrupted"] = True
    rec["stop"] = stop  # kept so a redraw or a resume says what the turn said
    if model:
        rec["model"] = model
    rec["thinking"] = thinking
    if thinking and effort is not None:
        rec["effort"] = effort
    rec["sampler"] = ({"greedy": True} if sampler.greedy else
                      {"greedy": False, "temperature": sampler.temperature, "top_p": sampler.top_p,
                       "top_k": sampler.top_k, "seed": sampler.seed})
    rec["tokens"] = {"prompt": prompt, "reused": reused, "prefilled": prompt - reused, "generated": generated}
    return rec


def sampler_settings(
    *, sampling: bool, temperature: float, top_p: float, top_k: int, seed: int | None,
    records: Sequence[Mapping[str, Any]] = (),
) -> SamplerSettings:
    """SamplerSettings for a conversation. Without a seed, the one stored with the session's
    last sampled answer is reused (one seed per conversation, spec 4), else a random one."""
    if seed is None:
        for rec in reversed(records):
            stored = rec.get("sampler") if rec.get("role") == "assistant" else None
            if isinstance(stored, dict) and isinstance(stored.get("seed"), int):
                seed = stored["seed"]
                break
    if seed is None:
        seed = secrets.randbits(64)
    return SamplerSettings(greedy=not sampling, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


# --------------------------------------------------------------------------- the loop


class _SamplerLike(Protocol):
    def sample(self, logits: Any) -> int: ...


@dataclass
class _Snap:
    snap_id: int
    ids: list[int]


def _extends(prefix: Sequence[int], ids: Sequence[int]) -> bool:
    """Spec 5.3: 0 < |F| < |P| and P begins with every id of F."""
    n = len(prefix)
    return 0 < n < len(ids) and list(ids[:n]) == list(prefix)


def _is_prefix(prefix: Sequence[int], ids: Sequence[int]) -> bool:
    n = len(prefix)
    return n <= len(ids) and list(ids[:n]) == list(prefix)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class Conversation:
    """One session's conversation on an open model.

    Not thread-safe, except ``cancel()``, which any thread (or a signal handler) may call
    while a turn runs. Settings (``thinking``, ``effort``, ``sampler``, ``max_tokens``) are
    plain attributes and apply from the next turn.
    """

    def __init__(
        self,
        model: EngineModel,
        tokenizer: Tokenizer,
        store: HistoryStore,
        session_id: str,
        *,
        thinking: bool = True,
        effort: str | None = "max",
        sampler: SamplerSettings | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        context: int | None = None,  # N_ctx: pass the context the memory plan was made for
        state_files: bool = True,
        fingerprint: str | None = None,
        model_name: str | None = None,
        max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
        stats_every: int = 8,
        sampler_factory: Callable[[SamplerSettings, int], _SamplerLike] = Sampler,
        prefill_piece: int | None = None,  # tokens per engine call in a prefill; None: engine_prefill_piece
        speculative: int = 0,
    ) -> None:
        tokenizer.engine_vocab_check(model.config.vocab)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        check_speculative(speculative)
        self.model = model
        self.tokenizer = tokenizer
        self.grammar = Grammar(tokenizer)
        self.store = store
        self.session_id = session_id
        self.thinking = thinking
        self.effort = effort
        self.sampler = sampler or SamplerSettings()
        self.max_tokens = max_tokens
        # drafted tokens verified per engine pass (0: one token per pass); output never changes
        self.speculative = speculative
        model_dir = getattr(model, "dir", None)
        # N_ctx is the session's capacity, allocated once: the plan's context, never more, so
        # the state can never outgrow the memory planned for it (no growth, no second copy).
        max_positions = model_max_positions(model_dir) if model_dir else None
        if context is None:
            context = default_context(model_dir)
        if not isinstance(context, int) or isinstance(context, bool) or context < 1:
            raise ValueError(f"context must be a positive number of positions, got {context!r}")
        if max_positions is not None and context > max_positions:
            raise ValueError(f"a context of {context:,} positions is more than the model's "
                             f"max_position_embeddings ({max_positions:,})")
        self.context = min(context, 2**31 - 2)
        self.state_files = state_files
        self._fingerprint = fingerprint
        self.model_name = model_name if model_name is not None else (Path(model_dir).name if model_dir else None)
        self.max_snapshots = max(0, max_snapshots)
        self.stats_every = max(1, stats_every)
        self._sampler_factory = sampler_factory
        if prefill_piece is not None and prefill_piece < 1:
            raise ValueError(f"prefill_piece must be >= 1 token, got {prefill_piece}")
        self.prefill_piece = prefill_piece if prefill_piece is not None else engine_prefill_piece(model)
        loaded = store.load(session_id)
        self._records: list[dict[str, Any]] = list(loaded.records)
        self.load_problems: list[str] = list(loaded.problems)
        self.session_settings: dict[str, Any] = dict(getattr(loaded, "settings", {}))  # as stored, unchecked
        self._session: EngineSession | None = None
        self._fed: list[int] | None = None  # None: unknown (tainted)
        self._snaps: list[_Snap] = []
        self._state_file_tried = not state_files
        self._saved_ids: list[int] | None = None  # what the state file on disk holds, when known
        self._cancel = threading.Event()
        self._aborted = threading.Event()
        self._engine_cancel: Any = None
        self._phase = "idle"  # idle, prefill, decode, sync, save: what cancel() may interrupt
        if state_files:
            try:
                sweep_state_temps()
            except OSError as exc:
                log.warning("stale state temp files not removed: %s", exc)

    @property
    def _live(self) -> EngineSession:
        """The engine session; every caller runs after _ensure_session opened it."""
        assert self._session is not None, "no engine session open"
        return self._session

    # ------------------------------------------------------------------ public API

    @property
    def records(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._records]

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            model_dir = getattr(self.model, "dir", None)  # not part of the seam: fakes pass fingerprint=
            if model_dir is None:
                raise ValueError("the model has no checkpoint directory to fingerprint; pass fingerprint=")
            self._fingerprint = model_fingerprint_for(model_dir)
        return self._fingerprint

    @property
    def context_used(self) -> int:
        return len(self._fed) if self._fed is not None else 0

    def history_tokens(self) -> int:
        """The context figure between turns: the stored history as the model reads it (what a
        saved state holds and the next start reuses). During a turn, ``context_used`` is it
        plus what the turn has fed so far."""
        return len(self._render_ids(self._records, False)) if self._records else 0

    @property
    def pending_user(self) -> bool:
        """The history ends with an unanswered user message (after a crash, or a prefill that
        was stopped): respond() answers it, reusing what a stopped prefill read."""
        return bool(self._records) and self._records[-1].get("role") == "user"

    @property
    def reserve(self) -> int:
        """Positions kept free after len(P) + G + 1 (see CLOSE_SLACK)."""
        return len(self.grammar.boundary) + len(self.grammar.closure) + 1 + CLOSE_SLACK

    def cancel(self) -> None:
        """Stop the turn in flight after the step in flight (thread-safe; a signal handler may
        call it). The partial answer is kept and the state stays reusable. During a prefill
        the step is one piece of the prompt (prefill_piece tokens): the prefill stops at the
        next piece boundary, no answer is stored and the state read so far is saved, so
        respond() continues from there. During the state sync after a turn the engine may
        abort between layers instead; that costs a re-prefill next time, nothing else."""
        self._cancel.set()
        flag = self._engine_cancel
        if flag is not None and self._phase not in ("decode", "prefill"):
            flag.set()

    def abort(self) -> None:
        """Stop now (thread-safe): also abort the engine step in flight between two layers
        (a second Ctrl-C). The step raises Cancelled and taints the state (the next turn
        prefills); what was generated is still parsed leniently and saved, marked interrupted,
        and the engine state is not saved."""
        self._aborted.set()
        self._cancel.set()
        flag = self._engine_cancel
        if flag is not None:
            flag.set()

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def prompt_ids(self, text: str | None = None, attachments: Sequence[Attachment] = ()) -> list[int]:
        """The ids of the next prompt (with ``text`` and ``attachments`` as a new user message),
        for a context meter or a check before sending. Raises ContextOverflow like send() would."""
        records = self._records + ([user_record(text, attachments)] if text is not None else [])
        prompt, _ = self._encode(records)
        self._check_fits(prompt)
        return prompt

    def send(self, text: str, *, system: str | None = None, attachments: Sequence[Attachment] = (),
             on_event: EventHandler = ignore) -> TurnResult | None:
        """A new user message (``text`` with ``attachments``, see k3chat.attachments) and its
        answer. An empty message without attachments is ignored (returns None).

        ``system`` starts an empty conversation with a system message; it is committed with
        the user message, after the overflow check, so a refused first turn leaves no trace.
        """
        if text == "" and not attachments:
            return None
        if self.pending_user:
            self.store.check_idle(self.session_id)  # SessionBusy: that message is being answered elsewhere
            raise ConversationError("the last message has no answer yet: respond to it, or edit it")
        new: list[dict[str, Any]] = []
        if system is not None:
            if self._records:
                raise ConversationError("a system message can only start a conversation")
            new.append({"role": "system", "content": system})
        new.append(user_record(text, attachments))

        def commit() -> None:
            for record in new:
                self._append(record)

        return self._turn(self._records + new, commit, on_event)

    def respond(self, *, on_event: EventHandler = ignore) -> TurnResult:
        """Answer the history's last user message (a session that ended in one, spec 5.1)."""
        if not self.pending_user:
            raise ConversationError("there is no unanswered message")
        return self._turn(list(self._records), lambda: None, on_event)

    def regenerate(self, *, on_event: EventHandler = ignore) -> TurnResult:
        """Replace the last answer with a new one (same sampler turn number)."""
        if not self._records or self._records[-1].get("role") != "assistant":
            raise ConversationError("there is no answer to regenerate")
        keep = len(self._records) - 1
        return self._turn(self._records[:keep], lambda: self._truncate(keep), on_event)

    def edit_last(self, text: str, *, on_event: EventHandler = ignore) -> TurnResult | None:
        """Replace the last user message (and its answer) with ``text``, then answer it. Its
        attachments stay with it."""
        if text == "":
            return None
        last_user = max((i for i, r in enumerate(self._records) if r.get("role") == "user"), default=None)
        if last_user is None:
            raise ConversationError("there is no message to edit")
        edited = {"role": "user", "content": text}
        if self._records[last_user].get("attachments"):
            edited["attachments"] = self._records[last_user]["attachments"]
        records = self._records[:last_user] + [edited]

        def commit() -> None:
            self._truncate(last_user)
            self._append(dict(edited))

        return self._turn(records, commit, on_event)

    def held_prompt(self) -> tuple[int, int, str | None] | None:
        """For an unanswered last message (a prefill that was stopped): (tokens of its prompt
        the saved state holds, the prompt's length, why a state file was refused or None),
        with the engine brought to that state now, so respond() continues from it without
        reading the file again. None when nothing is pending or the prompt does not fit."""
        if not self.pending_user:
            return None
        try:
            prompt = self.prompt_ids()
        except ContextOverflow:
            return None  # respond() says so, with the numbers
        self._ensure_session()
        reused, _source, note = self._position_at(prompt)
        return reused, len(prompt), note

    def save_state_now(self) -> str | None:
        """Save the engine state for the stored history without computing anything, for a
        front-end that is quitting or leaving the session whatever the way (a stopped or
        aborted turn skips the state file, see _checkpoint): the live state if it lines up
        with the history, else the longest turn-boundary snapshot that does, so the next
        start re-reads only what came after it. Not cancellable (a third Ctrl-C exits).

        Returns None when a state for the history is on disk (written now, or already, or
        nothing was computed in this run), else why not, for the user."""
        from k3engine.model import EngineError

        if not self.state_files or self._session is None:
            return None
        rendered = self._history_ids()
        live = self._live_usable() and bool(self._fed) and _is_prefix(self._fed or [], rendered)
        snaps = [s for s in self._snaps if _is_prefix(s.ids, rendered)]
        best = max(snaps, key=lambda s: len(s.ids), default=None)
        length = len(self._fed or []) if live else (len(best.ids) if best is not None else 0)
        saved = self._saved_ids
        if saved is not None and len(saved) >= length and _is_prefix(saved, rendered):
            return None
        again = f"the next start re-reads the conversation ({len(rendered):,} tokens)"
        if length == 0:
            return f"engine state not saved: none of this conversation is held in a reusable state; {again}"
        try:
            if not live and best is not None:
                self._live.restore(best.snap_id)
                self._fed = list(best.ids)
            self._write_state()
        except (OSError, EngineError, ValueError, statefile.SaveCancelled) as exc:
            return f"engine state not saved ({exc}); {again}"
        return None

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session, self._fed, self._snaps = None, None, []

    # ------------------------------------------------------------------ history

    def _append(self, record: dict[str, Any]) -> dict[str, Any]:
        stored = self.store.append(self.session_id, record)
        self._records.append(stored)
        return stored

    def _truncate(self, keep: int) -> None:
        loaded = self.store.truncate(self.session_id, keep)
        self._records = list(loaded.records)

    # ------------------------------------------------------------------ prompts

    def _render_ids(self, records: Sequence[Mapping[str, Any]], generation: bool) -> list[int]:
        # Attachments become text before the template sees them (k3chat.attachments).
        segments = render([model_message(r) for r in records], thinking=self.thinking, effort=self.effort if self.thinking else None,
                          add_generation_prompt=generation)
        return encode(segments, self.tokenizer)

    def _history_ids(self) -> list[int]:
        """What a saved state must begin with: the stored history as the model reads it; for
        an unanswered last message, the prompt that answers it (a stopped prefill may hold
        part of its generation prompt)."""
        return self._render_ids(self._records, self.pending_user)

    def _encode(self, records: Sequence[Mapping[str, Any]]) -> tuple[list[int], int]:
        """(P, |B|): the prompt, and the length of its part before the last user message
        (the turn boundary, where a snapshot makes regenerate and edit-last cheap)."""
        prompt = self._render_ids(records, True)
        boundary = len(self._render_ids(records[:-1], False))
        return prompt, boundary

    def _check_fits(self, prompt: Sequence[int]) -> None:
        # Spec 5.2 step 3 (len(P) + G + 1 > N_ctx), plus room to close an answer cut at G.
        if len(prompt) + self.max_tokens + 1 + self.reserve > self.context:
            raise ContextOverflow(len(prompt), self.max_tokens, self.context, self.reserve)

    # ------------------------------------------------------------------ engine state

    def _ensure_session(self) -> None:
        """The engine session, allocated once at the full context (N_ctx)."""
        if self._session is None:
            self._session = self.model.session(self.context)
            self._fed = []

    def _live_usable(self) -> bool:
        return self._session is not None and self._fed is not None and not self._session.tainted

    def _position_at(self, prompt: Sequence[int]) -> tuple[int, str | None, str | None]:
        """Bring the session to the longest reusable prefix of ``prompt``.

        Returns (reused length, source, note): note says why a state file was not used.
        """
        best_len, best_src, best_snap = 0, None, None
        if self._live_usable() and _extends(self._fed or [], prompt):
            best_len, best_src = len(self._fed or []), "live"
        for snap in self._snaps:
            if len(snap.ids) > best_len and _extends(snap.ids, prompt):
                best_len, best_src, best_snap = len(snap.ids), "snapshot", snap
        note = None
        if not self._state_file_tried:
            self._state_file_tried = True
            payload, ids, note = self._read_state_file(prompt)
            if payload is not None and ids is not None and len(ids) > best_len:
                try:
                    self._live.import_state(payload)
                    if self._live.length != len(ids):
                        raise ValueError(f"the engine holds {self._live.length} positions after import, "
                                         f"the file {len(ids)}")
                    self._fed = list(ids)
                    self._saved_ids = list(ids)
                    return len(ids), "state_file", None
                except Exception as exc:
                    self._fed = None  # whatever import did, the live state is gone
                    reused, source, _ = self._position_at(prompt)  # snapshots, else a full prefill
                    return reused, source, f"saved state refused (import failed: {exc}); prefilling the history"
        if best_src == "snapshot" and best_snap is not None:
            try:
                self._live.restore(best_snap.snap_id)
                self._fed = list(best_snap.ids)
            except Exception as exc:
                log.warning("snapshot restore failed (%s); prefilling", exc)
                self._snaps.remove(best_snap)
                return self._position_at(prompt)
        elif best_src is None:
            self._fresh()
        return best_len, best_src, note

    def _fresh(self) -> None:
        if self._fed is None or self._fed or self._live.tainted or self._live.length:
            self._live.reset()
        self._fed = []

    def _read_state_file(self, prompt: Sequence[int]) -> tuple[bytes | None, list[int] | None, str | None]:
        """(payload, ids, None) for a usable state file, else (None, None, reason)."""
        path = state_path(self.session_id)
        has_history = any(r.get("role") == "assistant" for r in self._records)
        try:
            sf = statefile.load_state(path, fingerprint=self.fingerprint, vault=self.store.vault)
        except statefile.StateFileError as exc:
            if exc.reason == statefile.MISSING:
                return None, None, ("no saved engine state for this session; prefilling the history"
                                    if has_history else None)
            return None, None, f"saved state refused ({exc.reason}: {exc.detail}); prefilling the history"
        try:
            from k3engine.model import decode_state
            ids = [int(i) for i in decode_state(sf.payload).ids]
        except Exception as exc:
            return None, None, f"saved state refused (unreadable engine state: {exc}); prefilling the history"
        if len(ids) != sf.n_tokens:
            return None, None, (f"saved state refused (the file says {sf.n_tokens} tokens, the state holds "
                                f"{len(ids)}); prefilling the history")
        if not _extends(ids, prompt):
            at = _first_difference(ids, prompt)
            why = (f"it holds {len(ids)} tokens, the prompt has {len(prompt)}" if len(ids) >= len(prompt)
                   else f"it differs from the conversation at token {at}")
            return None, None, f"saved state does not match the history ({why}); prefilling the history"
        return sf.payload, ids, None

    def _snapshot_here(self) -> bool:
        """Keep a snapshot of the current state, never more than max_snapshots at any moment:
        the oldest is dropped *before* the new copy is made (the plan has room for that many
        and no more). True if the current state is now held by a snapshot."""
        if self.max_snapshots == 0 or not self._live_usable() or not self._fed:
            return False
        fed = self._fed
        if any(len(s.ids) == len(fed) and s.ids == fed for s in self._snaps):
            return True
        while len(self._snaps) >= self.max_snapshots:
            old = self._snaps.pop(0)
            try:
                self._live.drop_snapshot(old.snap_id)
            except Exception:
                pass
        try:
            snap_id = self._live.snapshot()
        except Exception as exc:  # out of memory for a copy: an optimisation lost, nothing else
            log.warning("no turn-boundary snapshot: %s", exc)
            return False
        self._snaps.append(_Snap(snap_id, list(fed)))
        return True

    def _feed(self, ids: Sequence[int], *, cancellable: bool) -> Any:
        """Feed and mirror into _fed; a failed or cancelled feed leaves _fed unknown."""
        try:
            logits = self._live.feed(list(ids), cancel=self._engine_cancel if cancellable else None)
        except BaseException:
            self._fed = None
            raise
        assert self._fed is not None
        self._fed.extend(int(i) for i in ids)
        return logits

    def _prefill(self, ids: Sequence[int], meter: PrefillMeter) -> Any:
        """Feed a prompt tail in pieces of prefill_piece tokens, counted by ``meter``. A
        cancel() seen between two pieces raises _PrefillStopped with the state intact (it
        holds every piece fed); the output bits do not depend on the piece size."""
        piece = self.prefill_piece or len(ids)
        logits: Any = None
        for start in range(0, len(ids), piece):
            if self._cancel.is_set():
                raise _PrefillStopped
            part = ids[start:start + piece]
            logits = self._feed(part, cancellable=True)
            meter.advance(len(part))
        return logits

    # ------------------------------------------------------------------ one turn

    def _turn(self, records: list[dict[str, Any]], commit: Callable[[], None], on_event: EventHandler) -> TurnResult:
        # One k3chat answers a session at a time: another gets SessionBusy (with this pid)
        # before it changes anything, instead of a refused save or advice to --resume.
        with self.store.answering(self.session_id):
            return self._answer(records, commit, on_event)

    def _answer(self, records: list[dict[str, Any]], commit: Callable[[], None], on_event: EventHandler) -> TurnResult:
        prompt, boundary = self._encode(records)
        self._check_fits(prompt)  # before the history changes (spec 5.2 step 3)
        commit()  # spec 5.2 step 4: the user record is durable before any compute
        from k3engine.model import CancelFlag

        if self._engine_cancel is None:
            self._engine_cancel = CancelFlag()
        self._phase = "prefill"
        if self._cancel.is_set():  # asked to stop before the turn started
            self._engine_cancel.set()
        try:
            return self._generate(prompt, boundary, on_event)
        finally:
            self._phase = "idle"
            self._cancel.clear()
            self._aborted.clear()
            self._engine_cancel.clear()

    def _generate(self, prompt: list[int], boundary: int, on_event: EventHandler) -> TurnResult:
        from k3engine.model import Cancelled, EngineError
        from k3chat.sampler import SamplerError

        turn = sum(1 for r in self._records if r.get("role") == "assistant") + 1
        thinking, effort, settings, limit = self.thinking, self.effort, self.sampler, self.max_tokens
        emit = on_event
        self._ensure_session()
        reused, source, note = self._position_at(prompt)
        if note:
            emit(Notice("state", note))
        st = _TurnState(prompt_tokens=len(prompt), reused=reused, source=source, note=note, turn=turn,
                        thinking=thinking, effort=effort, settings=settings)
        emit(Prefill(len(prompt), reused, len(prompt) - reused, source))
        emit(PhaseChanged("prefill"))
        t0 = time.perf_counter()
        meter = PrefillMeter(len(prompt) - reused, emit)
        meter.start()
        try:
            # One snapshot per turn (the plan budgets one): the turn boundary, which makes
            # regenerate and edit-last cheap; with nothing before this message, the prompt
            # itself, so a state sync after the answer restarts there rather than at 0.
            at_boundary = False
            # Past the boundary (a stopped prefill read part of this message), the snapshot
            # waits for the whole prompt: a state sync then never re-reads the message.
            if boundary - 1 <= reused <= boundary and reused > 0:
                at_boundary = self._snapshot_here()  # this turn's start (the end of the last)
            elif boundary > reused:
                self._prefill(prompt[reused:boundary], meter)
                at_boundary = self._snapshot_here()
            logits = self._prefill(prompt[len(self._fed or []):], meter)
            if not at_boundary:
                self._snapshot_here()
        except (_PrefillStopped, Cancelled):  # Cancelled: abort() stopped the piece in flight
            st.prefill_s = time.perf_counter() - t0
            return self._prefill_stopped(st, meter, emit)
        except (EngineError, MemoryError) as exc:
            st.prefill_s = time.perf_counter() - t0
            raise self._failed(st, [], exc, emit) from exc
        st.prefill_s = time.perf_counter() - t0
        self._emit_stats(st, 0, emit)

        sampler = self._sampler_factory(settings, turn)
        parser = StreamParser(self.grammar, thinking)
        phase = "reasoning" if thinking else "answer"
        emit(PhaseChanged(phase))  # type: ignore[arg-type]
        generated: list[int] = []
        self._phase = "decode"  # from here a first cancel() lets the step in flight finish
        stop = "cancelled" if self._cancel.is_set() else ""
        # an engine that cannot verify in one pass decodes serially: the output is the same
        verifies = isinstance(self._session, VerifyingSession)
        spec = _speculator(self) if self.speculative > 0 and verifies else None
        t1 = time.perf_counter()
        try:
            while not stop:
                token = int(sampler.sample(logits))
                if not generated:
                    st.first_token_s = time.perf_counter() - t0
                generated.append(token)
                if spec is not None:
                    spec.sampled(token)
                for channel, text in parser.push(token):
                    if channel == "content" and phase != "answer":
                        phase = "answer"
                        st.reasoning_s = time.perf_counter() - t1
                        emit(PhaseChanged("answer"))
                    emit(ReasoningToken(text) if channel == "reasoning" else AnswerToken(text))
                if parser.channel == "content" and phase != "answer":
                    phase = "answer"
                    st.reasoning_s = time.perf_counter() - t1
                    emit(PhaseChanged("answer"))
                if token in self.grammar.end_ids:
                    stop = "end"  # never fed (spec 1.7)
                elif len(generated) >= limit:
                    stop = "limit"  # the last id is not fed either: F stays exact
                elif self._cancel.is_set():
                    stop = "cancelled"  # checked at the top of the next step (spec 5.4)
                else:
                    # The step in flight completes on cancel(); only abort() sets the engine's
                    # flag during decoding, and then the step stops between layers.
                    try:
                        if spec is not None:
                            logits = spec.next_logits(token, room=limit - len(generated))
                        else:
                            logits = self._feed([token], cancellable=True)
                    except Cancelled:
                        stop = "cancelled"  # the state is tainted; the text is kept below
                        break
                    st.decode_s = time.perf_counter() - t1
                    if spec is not None:
                        st.draft_proposed, st.draft_accepted = spec.proposed, spec.accepted
                    if len(generated) % self.stats_every == 0:
                        self._emit_stats(st, len(generated), emit)
        except (EngineError, SamplerError, MemoryError) as exc:
            st.decode_s = time.perf_counter() - t1
            _settle_quietly(spec, st)
            self._flush(parser, emit, phase)
            raise self._failed(st, generated, exc, emit) from exc
        except BaseException:
            # KeyboardInterrupt or a failing event handler: keep what was generated.
            st.decode_s = time.perf_counter() - t1
            _settle_quietly(spec, st)
            self._save_quietly(st, generated)
            raise
        if spec is not None:
            spec.settle()  # the verified positions the sampler went through are fed; no more
            st.draft_proposed, st.draft_accepted = spec.proposed, spec.accepted
        st.decode_s = time.perf_counter() - t1
        st.turn_s = time.perf_counter() - t0
        self._flush(parser, emit, phase)
        return self._finish(st, generated, stop, emit)

    def _flush(self, parser: StreamParser, emit: EventHandler, phase: str) -> None:
        for channel, text in parser.finish():
            emit(ReasoningToken(text) if channel == "reasoning" else AnswerToken(text))

    # ------------------------------------------------------------------ ending a turn

    def _parse(self, st: _TurnState, generated: list[int], stop: str) -> tuple[ParsedTurn, str, str | None]:
        if stop == "end":
            try:
                return self.grammar.parse_strict(generated, st.thinking), "end", None
            except MalformedTurn as exc:
                return (self.grammar.parse_lenient(generated, st.thinking), "malformed",
                        f"the model's answer is malformed ({exc.reason}); what it said was kept, marked interrupted")
        return self.grammar.parse_lenient(generated, st.thinking), stop, stop_message(stop, len(generated))

    def _record(self, st: _TurnState, parsed: ParsedTurn, stop: str, generated: list[int]) -> dict[str, Any]:
        rec = assistant_record(content=parsed.content, reasoning=(parsed.reasoning or "") if st.thinking else None,
                               stop=stop, model=self.model_name, effort=st.effort, sampler=st.settings,
                               prompt=st.prompt_tokens, reused=st.reused, generated=len(generated))
        if st.thinking:
            rec["tokens"]["reasoning"] = self._reasoning_count(generated)
        speed = {}
        thought_s = st.reasoning_s or st.decode_s  # no answer yet: all of the decoding was reasoning
        if st.thinking and thought_s > 0:
            speed["reasoning_seconds"] = round(thought_s, 3)
        if st.prefill_s > 0 and st.prompt_tokens > st.reused:
            speed["prefill_tokens_per_second"] = round((st.prompt_tokens - st.reused) / st.prefill_s, 3)
        if st.decode_s > 0 and len(generated) > 1:
            speed["decode_tokens_per_second"] = round((len(generated) - 1) / st.decode_s, 3)
        if generated and st.first_token_s > 0:
            speed["first_token_seconds"] = round(st.first_token_s, 3)  # from the start of the prefill
        turn_s = st.turn_s or st.prefill_s + st.decode_s  # a turn that failed has no end time of its own
        if turn_s > 0:
            speed["turn_seconds"] = round(turn_s, 3)  # prefill to the last sampled id
        if speed:
            rec["speed"] = speed
        return rec

    def _reasoning_count(self, generated: Sequence[int]) -> int:
        """Sampled ids before the reasoning/answer boundary (all of them without one)."""
        n = len(self.grammar.boundary)
        for i in range(len(generated) - n + 1):
            if tuple(generated[i:i + n]) == tuple(self.grammar.boundary):
                return i
        return len(generated)

    def _result(self, st: _TurnState, record: dict[str, Any], parsed: ParsedTurn, stop: str,
                message: str | None, generated: list[int], saved: bool) -> TurnResult:
        s = st.settings
        return TurnResult(
            session_id=self.session_id, turn=st.turn, record=record, reasoning=parsed.reasoning,
            answer=parsed.content, interrupted=bool(record.get("interrupted")), stop=stop, message=message,
            prompt_tokens=st.prompt_tokens, reused_tokens=st.reused, prefilled_tokens=st.prompt_tokens - st.reused,
            reuse_source=st.source, reuse_note=st.note, generated_ids=list(generated),
            prefill_seconds=st.prefill_s, decode_seconds=st.decode_s, seed=None if s.greedy else s.seed,
            greedy=s.greedy, saved=saved, engine=self._engine_stats(),
            draft_proposed=st.draft_proposed, draft_accepted=st.draft_accepted,
        )

    def _finish(self, st: _TurnState, generated: list[int], stop: str, emit: EventHandler) -> TurnResult:
        parsed, stop, message = self._parse(st, generated, stop)
        record = self._record(st, parsed, stop, generated)
        stored = self._append(record)  # a HistoryError here propagates: the caller must know
        result = self._result(st, stored, parsed, stop, message, generated, saved=True)
        if message:
            emit(Notice(stop, message))
        if self.state_files:
            self._checkpoint(result, emit, cancelled=(stop == "cancelled"))
        self._emit_stats(st, len(generated), emit)
        emit(PhaseChanged("done"))
        emit(TurnDone(result))
        return result

    def _prefill_stopped(self, st: _TurnState, meter: PrefillMeter, emit: EventHandler) -> TurnResult:
        """Stopped while the prompt was read: no answer is stored, so the user message stays
        unanswered (pending_user) and respond() answers it. The state up to the last piece
        fed is saved (unless abort() tainted it), so that respond() feeds only the rest."""
        meter.close()
        s = st.settings
        result = TurnResult(
            session_id=self.session_id, turn=st.turn, record={}, reasoning=None, answer="", interrupted=True,
            stop="cancelled", message=None, prompt_tokens=st.prompt_tokens, reused_tokens=st.reused,
            prefilled_tokens=meter.done, reuse_source=st.source, reuse_note=st.note, generated_ids=[],
            prefill_seconds=st.prefill_s, decode_seconds=0.0, seed=None if s.greedy else s.seed, greedy=s.greedy,
            engine=self._engine_stats(), pending=True)
        usable = self._live_usable() and bool(self._fed)
        if self.state_files and usable and not self._aborted.is_set():
            if self._saved_ids == self._fed:
                result.state_saved = True  # nothing was read since the state file was written
            else:
                self._save_state(result, emit)
        result.message = self._stopped_message(st.prompt_tokens, st.reused + meter.done, result.state_saved)
        emit(Notice("cancelled", result.message))
        emit(Stats(prompt_tokens=st.prompt_tokens, reused_tokens=st.reused, prefilled_tokens=meter.done,
                   generated_tokens=0, prefill_seconds=st.prefill_s, decode_seconds=0.0,
                   context_used=self.context_used, context_limit=self.context, engine=result.engine))
        emit(PhaseChanged("done"))
        emit(TurnDone(result))
        return result

    def _stopped_message(self, prompt_tokens: int, held: int, state_saved: bool) -> str:
        kept = "the message is kept, not yet answered"
        if not held:
            return f"stopped before any of the prompt was read; {kept}"
        where = f"stopped while reading the prompt at token {held:,} of {prompt_tokens:,}; {kept}"
        rest = f"answering it reads only the remaining {prompt_tokens - held:,} tokens"
        if state_saved:
            return f"{where}, and what was read is saved: {rest}"
        if self._live_usable():
            return f"{where}; {rest} while this session stays open"
        return f"{where}; the step in flight was aborted, so answering it reads the prompt again"

    def _failed(self, st: _TurnState, generated: list[int], exc: BaseException, emit: EventHandler) -> TurnFailed:
        parsed, _, _ = self._parse(st, generated, "error")
        record = self._record(st, parsed, "error", generated)
        try:
            stored, saved = self._append(record), True
        except Exception as save_exc:  # report both; the engine failure is the cause
            log.error("could not save the partial answer: %s", save_exc)
            stored, saved = record, False
        result = self._result(st, stored, parsed, "error", f"the turn failed: {exc}", generated, saved)
        emit(Notice("error", result.message or str(exc)))
        emit(PhaseChanged("done"))
        emit(TurnDone(result))
        return TurnFailed(result, exc)

    def _save_quietly(self, st: _TurnState, generated: list[int]) -> None:
        try:
            parsed = self.grammar.parse_lenient(generated, st.thinking)
            self._append(self._record(st, parsed, "error", generated))
        except Exception as exc:
            log.error("could not save the partial answer: %s", exc)

    def _checkpoint(self, result: TurnResult, emit: EventHandler, *, cancelled: bool) -> None:
        """Save the engine state for the next run. If what was fed is not a prefix of the
        stored history (an answer cut at a control id, or text that re-encodes differently),
        first bring the state in line from a snapshot, unless the user asked to stop. After
        abort() nothing is done: the user wants out now."""
        from k3engine.model import Cancelled, EngineError

        if self._aborted.is_set():
            return
        rendered = self._render_ids(self._records, False)
        in_line = self._live_usable() and self._fed and _is_prefix(self._fed, rendered)
        if not in_line and not cancelled and not self._cancel.is_set():
            if len(rendered) > self._live.capacity:
                emit(Notice("state", f"engine state not saved (the stored history is {len(rendered)} tokens, "
                                     f"the context {self._live.capacity}); the next run prefills the history"))
                return
            candidates = [s for s in self._snaps if _extends(s.ids, rendered)]
            best = max(candidates, key=lambda s: len(s.ids), default=None)
            start = len(best.ids) if best is not None else 0
            emit(PhaseChanged("sync"))
            self._phase = "sync"
            if self._cancel.is_set():  # a cancel() that saw the decode phase
                self._engine_cancel.set()
            try:
                if best is not None:
                    self._live.restore(best.snap_id)
                    self._fed = list(best.ids)
                else:
                    self._fresh()
                if start < len(rendered):
                    self._feed(rendered[start:], cancellable=True)
                    result.sync_tokens = len(rendered) - start
            except Cancelled:
                return  # stopped on request: the next run prefills
            except (EngineError, MemoryError, ValueError) as exc:
                log.warning("engine state not brought in line with the history: %s", exc)
            finally:
                self._phase = "save"
        if self._aborted.is_set() or not (self._live_usable() and self._fed and _is_prefix(self._fed, rendered)):
            return
        self._save_state(result, emit)

    def _save_state(self, result: TurnResult, emit: EventHandler) -> None:
        from k3engine.model import EngineError

        try:
            self._write_state(cancel=self._aborted.is_set)
            result.state_saved = True
        except statefile.SaveCancelled:
            pass  # abort(): the user wants out; the next run prefills
        except (OSError, EngineError, ValueError) as exc:
            emit(Notice("state", f"engine state not saved ({exc}); the next run prefills the history"))

    def _write_state(self, cancel: Callable[[], bool] | None = None) -> None:
        """The live state to the session's state file (raises what statefile and the engine raise)."""
        path = state_path(self.session_id)
        paths.ensure_private_dir(paths.state_dir())
        payload = self._live.export_state()  # the one extra copy, dropped right after
        try:
            statefile.save_state(path, payload, fingerprint=self.fingerprint, n_tokens=len(self._fed or []),
                                 cancel=cancel, vault=self.store.vault)
        finally:
            del payload
        self._saved_ids = list(self._fed or [])

    # ------------------------------------------------------------------ stats

    def _engine_stats(self) -> dict[str, int]:
        try:
            return dict(self.model.stats())
        except Exception:
            return {}

    def _emit_stats(self, st: _TurnState, n_generated: int, emit: EventHandler) -> None:
        emit(Stats(prompt_tokens=st.prompt_tokens, reused_tokens=st.reused,
                   prefilled_tokens=st.prompt_tokens - st.reused, generated_tokens=n_generated,
                   prefill_seconds=st.prefill_s, decode_seconds=st.decode_s,
                   context_used=self.context_used, context_limit=self.context, engine=self._engine_stats(),
                   draft_proposed=st.draft_proposed, draft_accepted=st.draft_accepted))


@dataclass
class _TurnState:
    prompt_tokens: int
    reused: int
    source: str | None
    note: str | None
    turn: int
    thinking: bool
    effort: str | None
    settings: SamplerSettings
    prefill_s: float = 0.0
    decode_s: float = 0.0
    reasoning_s: float = 0.0  # from the first sampled id to the start of the answer
    first_token_s: float = 0.0  # from the start of the prefill to the first sampled id
    turn_s: float = 0.0  # from the start of the prefill to the last sampled id
    draft_proposed: int = 0
    draft_accepted: int = 0


from k3engine.limits import MAX_SPECULATIVE  # noqa: E402 - one definition (the planner's too)


def check_speculative(n: object) -> int:
    """A valid --speculative / config value (0 = off), else ValueError saying what is wrong."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_SPECULATIVE:
        raise ValueError(f"speculative must be a whole number of drafted tokens from 0 (off) to "
                         f"{MAX_SPECULATIVE}, got {n!r}")
    return n


def _settle_quietly(spec: Speculator | None, st: _TurnState) -> None:
    """After a failed step: keep what the sampler went through; the failure is what counts."""
    if spec is None:
        return
    try:
        spec.settle()
    except Exception as exc:  # the mirror is already marked unknown: the next turn prefills
        log.warning("verified positions not accepted after a failure: %s", exc)
    st.draft_proposed, st.draft_accepted = spec.proposed, spec.accepted


def _speculator(conv: Conversation) -> Speculator:
    """Speculative decoding for one turn of ``conv`` (see k3chat.speculative.Speculator)."""
    session = conv._live
    assert isinstance(session, VerifyingSession)

    def fed(ids: Sequence[int]) -> None:
        assert conv._fed is not None
        conv._fed.extend(int(i) for i in ids)

    def lost() -> None:
        conv._fed = None

    return Speculator(session, conv._fed or [], limit=conv.speculative, stop_ids=conv.grammar.end_ids,
                      feed=lambda ids: conv._feed(ids, cancellable=True), fed=fed, lost=lost,
                      cancel=conv._engine_cancel)


__all__ = [
    "Conversation", "ConversationError", "ContextOverflow", "TurnFailed", "TurnResult",
    "model_fingerprint_for", "model_max_positions", "state_path", "delete_state", "sampler_settings", "user_record",
    "STOPS", "stop_message", "check_speculative", "MAX_SPECULATIVE",
    "Event",
]
