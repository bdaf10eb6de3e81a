"""User settings: ``config.toml`` in the platform config directory, overridden by the CLI.

Example (every key optional)::

    model = "~/models/kimi-k3"
    memory = "12G"            # a size (K/M/G/T), "auto", or a preset name
    max_tokens = 4096         # per-turn generation limit G (spec 5.2)
    speculative = 0           # drafted tokens verified per pass (0 = off); output is the same
    theme = "default"
    vim_keys = false          # the app: j/k, g/G move between blocks of the transcript
    remote = "https://k3.example:8000"   # an OpenAI-compatible server instead of the local model
    remote_model = "kimi-k3"             # omit for the server's first model
    api_key_file = "~/.config/k3chat/api-key"  # else K3CHAT_API_KEY; never stored in history
    remote_ca_file = "~/company-ca.pem"  # a private CA for the server's TLS certificate

    [thinking]
    enabled = true
    effort = "max"            # low | high | max (spec 1.5; "medium" is refused)
    display = "auto"          # expanded | auto | hidden

    [sampler]
    sampling = false          # greedy unless set, or implied by any value below
    temperature = 1.0
    top_p = 0.95
    top_k = 0                 # 0 = off
    seed = 42                 # omit for a random seed per conversation

    [keys]
    quit = "ctrl+q"           # action = key(s), handed to the app as is

A bad file is refused as a whole with the file, line and key: a silently ignored typo could
mean sampling when the user asked for reproducible greedy output.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3chat import paths

EFFORTS = ("low", "high", "max")
REASONING_DISPLAYS = ("expanded", "auto", "hidden")
# Named memory budgets. The planner (design 2.3) owns what they mean; keep the names in step.
MEMORY_PRESETS = ("small", "medium", "large", "huge")
_MEMORY_SIZE_RE = re.compile(r"(?i)([0-9]+(?:\.[0-9]+)?)\s*([KMGT])(?:I?B)?")
_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
_ACTION_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_U64_MAX = 2**64 - 1
# Setting any of these implies sampling, unless `sampling` is set in the same place (spec 4).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


class SettingsError(Exception):
    """A setting was refused. ``key`` is the TOML key (``sampler.top_p``) or the CLI option
    (``--top-p``); ``line`` is the 1-based line in the file, or None."""

    def __init__(self, message: str, *, key: str | None = None, line: int | None = None,
                 path: Path | None = None) -> None:
        where = ", ".join(part for part in (str(path) if path else "", f"line {line}" if line else "") if part)
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{key + ': ' if key else ''}{message}")
        self.key = key
        self.line = line
        self.path = path


@dataclass(frozen=True)
class Settings:
    model: Path | None = None
    memory: str = "auto"
    effort: str = "max"
    thinking: bool = True
    sampling: bool = False
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    seed: int | None = None  # None: a random u64 per conversation, shown and stored
    max_tokens: int = 4096
    speculative: int = 0  # exact speculative decoding: drafted tokens per verify pass, 0 = off
    theme: str = "default"
    reasoning_display: str = "auto"
    vim_keys: bool = False  # the app's j/k, g/G in the transcript (never while typing)
    keys: dict[str, str] = field(default_factory=dict)
    remote: str | None = None  # the API base of a remote server (k3chat.remote), normalised
    remote_model: str | None = None
    api_key_file: Path | None = None
    remote_ca_file: Path | None = None


# --------------------------------------------------------------------------- value checks
# Each takes the raw value and returns the stored one, or raises ValueError with the reason.


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {_kind(value)}")
    if not math.isfinite(value):
        raise ValueError(f"must be finite, got {value}")
    return float(value)


def _integer(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_kind(value)}")
    return value


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_kind(value)}")
    return value


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_kind(value)}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[object], str]:
    def check(value: object) -> str:
        if _string(value) not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {value!r}")
        return value  # type: ignore[return-value]
    return check


def _model(value: object) -> Path:
    if not _string(value).strip():
        raise ValueError("must be a path to the model directory")
    return Path(value).expanduser()  # type: ignore[arg-type]


def _remote(value: object) -> str:
    from .remote import normalise_url  # plain string work: no socket, no HTTP client
    return normalise_url(_string(value))


def _remote_model(value: object) -> str:
    if not _string(value).strip():
        raise ValueError("must be the name of a model the server serves")
    return str(value).strip()


def _key_file(value: object) -> Path:
    if not _string(value).strip():
        raise ValueError("must be a path to a file holding the API key")
    return Path(value).expanduser()  # type: ignore[arg-type]


def _model_like_path(value: object) -> Path:
    if not _string(value).strip():
        raise ValueError("must be a path to a PEM file")
    return Path(value).expanduser()  # type: ignore[arg-type]


def _memory(value: object) -> str:
    from k3engine.sizes import MemorySizeError, parse_memory

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f'needs a unit, as a string such as "{value}G"')
    text = _string(value).strip()
    if text.lower() == "all":  # every weight resident, no plan
        return "all"
    if text.isdigit():  # a bare number is almost surely a missing unit, not bytes
        raise ValueError(f'needs a unit, such as "{text}G"')
    try:
        parse_memory(text)  # one parser for budgets: the planner's
    except MemorySizeError as exc:
        raise ValueError(str(exc)) from None
    return text.lower() if text.lower() == "auto" or text.lower() in MEMORY_PRESETS else text


def _temperature(value: object) -> float:
    t = _number(value)
    if t <= 0:
        raise ValueError(f"must be > 0, got {value}")
    return t


def _top_p(value: object) -> float:
    p = _number(value)
    if not 0 < p <= 1:
        raise ValueError(f"must be > 0 and <= 1, got {value}")
    return p


def _top_k(value: object) -> int:
    k = _integer(value)
    if k < 0:
        raise ValueError(f"must be >= 0 (0 = off), got {value}")
    return k


def _seed(value: object) -> int:
    s = _integer(value)
    if not 0 <= s <= _U64_MAX:
        raise ValueError(f"must be between 0 and 2^64-1, got {value}")
    return s


def _max_tokens(value: object) -> int:
    n = _integer(value)
    if n < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return n


from k3engine.limits import MAX_SPECULATIVE  # noqa: E402 - one definition for every front-end


def _speculative(value: object) -> int:
    n = _integer(value)
    if not 0 <= n <= MAX_SPECULATIVE:
        raise ValueError(f"must be a number of drafted tokens from 0 (off) to {MAX_SPECULATIVE}, got {value}")
    return n


def _theme(value: object) -> str:
    if not _NAME_RE.fullmatch(_string(value)):
        raise ValueError(f"must be a theme name (letters, digits, - and _), got {value!r}")
    return value  # type: ignore[return-value]


def _binding(value: object) -> str:
    text = _string(value)
    if not text or any(ch.isspace() for ch in text):
        raise ValueError(f'must be a key such as "ctrl+q" (no spaces), got {value!r}')
    return text


def _kind(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             dict: "a table", list: "an array"}
    return names.get(type(value), type(value).__name__)


# TOML key -> (Settings field, check). The [keys] table is handled separately: its keys are
# action names chosen by the app.
_TOML_KEYS: dict[str, tuple[str, Callable[[object], Any]]] = {
    "model": ("model", _model),
    "memory": ("memory", _memory),
    "max_tokens": ("max_tokens", _max_tokens),
    "speculative": ("speculative", _speculative),
    "theme": ("theme", _theme),
    "vim_keys": ("vim_keys", _boolean),
    "remote": ("remote", _remote),
    "remote_model": ("remote_model", _remote_model),
    "api_key_file": ("api_key_file", _key_file),
    "remote_ca_file": ("remote_ca_file", _model_like_path),
    "thinking.enabled": ("thinking", _boolean),
    "thinking.effort": ("effort", _choice(EFFORTS)),
    "thinking.display": ("reasoning_display", _choice(REASONING_DISPLAYS)),
    "sampler.sampling": ("sampling", _boolean),
    "sampler.temperature": ("temperature", _temperature),
    "sampler.top_p": ("top_p", _top_p),
    "sampler.top_k": ("top_k", _top_k),
    "sampler.seed": ("seed", _seed),
}
_TABLES = ("thinking", "sampler", "keys")
_FIELD_CHECKS = {name: check for name, check in _TOML_KEYS.values()}


# --------------------------------------------------------------------------- loading


def load_settings(path: Path | None = None) -> Settings:
    """Settings from ``path`` (default: the platform config file); a missing file = defaults."""
    path = Path(path) if path is not None else paths.config_file()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Settings()
    except OSError as exc:
        raise SettingsError(f"cannot read the config file: {exc.strerror or exc}", path=path) from exc
    text = _decode(raw, path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"at line (\d+)", str(exc))
        line = int(match.group(1)) if match else None
        raise SettingsError(f"not valid TOML: {exc}", line=line, path=path) from None
    values = _values_from_toml(doc, text, path)
    return _with_values(Settings(), values)


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SettingsError("not valid UTF-8", line=line, path=path) from None


def _values_from_toml(doc: Mapping[str, Any], text: str, path: Path) -> dict[str, Any]:
    """Settings field -> checked value, for every key the file sets."""
    values: dict[str, Any] = {}
    for dotted, value in _flatten(doc, text, path):
        if dotted.startswith("keys."):
            values.setdefault("keys", {})[dotted[len("keys."):]] = _check(dotted, value, _binding, text, path)
            continue
        spec = _TOML_KEYS.get(dotted)
        if spec is None:
            raise _unknown_key(dotted, text, path)
        field_name, check = spec
        values[field_name] = _check(dotted, value, check, text, path)
    if "sampling" not in values and any(name in values for name in _SAMPLING_FIELDS):
        values["sampling"] = True
    return values


def _flatten(doc: Mapping[str, Any], text: str, path: Path) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        if key not in _TABLES:
            out.append((key, value))
            continue
        if not isinstance(value, dict):
            raise SettingsError(f"must be a table ([{key}]), got {_kind(value)}",
                                key=key, line=_find_line(text, (key,)), path=path)
        for sub, item in value.items():
            if key == "keys" and not _ACTION_RE.fullmatch(sub):
                raise SettingsError("not an action name", key=f"keys.{sub}",
                                    line=_find_line(text, ("keys", sub)), path=path)
            out.append((f"{key}.{sub}", item))
    return out


def _check(dotted: str, value: object, check: Callable[[object], Any], text: str, path: Path) -> Any:
    try:
        return check(value)
    except ValueError as exc:
        raise SettingsError(str(exc), key=dotted, line=_find_line(text, tuple(dotted.split("."))), path=path) from None


def _unknown_key(dotted: str, text: str, path: Path) -> SettingsError:
    known = [*_TOML_KEYS, "keys.<action>"]
    close = difflib.get_close_matches(dotted, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return SettingsError(f"unknown key{hint}", key=dotted, line=_find_line(text, tuple(dotted.split("."))), path=path)


# --------------------------------------------------------------------------- line finding
# tomllib gives values without positions, so the line of a key is found by scanning the text:
# table headers set the current table, and "a.b = ..." lines are matched by their full path.

_HEADER_RE = re.compile(r"^\s*\[\[?\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_RE = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def _split_key(text: str) -> tuple[str, ...]:
    parts = re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", text)
    return tuple(part.strip("\"'") for part in parts)


def _find_line(text: str, dotted: tuple[str, ...]) -> int | None:
    """Line of the key ``dotted``; else of its nearest enclosing key or table (an inline
    table or a header); else None."""
    table: tuple[str, ...] = ()
    best: tuple[int, int] | None = None  # (matched length, line)
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER_RE.match(line)
        if header:
            table = _split_key(header.group(1))
            candidate = table
        else:
            key = _KEY_RE.match(line)
            if not key:
                continue
            candidate = table + _split_key(key.group(1))
        if candidate == dotted:
            return number
        if dotted[: len(candidate)] == candidate and (best is None or len(candidate) > best[0]):
            best = (len(candidate), number)
    return best[1] if best else None


# --------------------------------------------------------------------------- the CLI


def merge_cli(settings: Settings, overrides: Mapping[str, Any]) -> Settings:
    """Command-line values over the file's. Keys are Settings field names; None means "not
    given" (argparse defaults). Strings are accepted for numbers and booleans; ``keys`` is
    merged into the file's bindings rather than replacing them."""
    values: dict[str, Any] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        option = "--" + name.replace("_", "-")
        if name == "keys":
            values["keys"] = {**settings.keys, **_cli_keys(value, option)}
            continue
        check = _FIELD_CHECKS.get(name)
        if check is None:
            raise SettingsError("unknown setting", key=option)
        try:
            values[name] = check(_coerce(name, value))
        except ValueError as exc:
            raise SettingsError(str(exc), key=option) from None
    # Giving a sampler value on the command line means sampling (spec 4, the peer's rule),
    # even if the file asked for greedy, unless the command line also says which.
    if "sampling" not in values and any(name in values for name in _SAMPLING_FIELDS):
        values["sampling"] = True
    return _with_values(settings, values)


def _cli_keys(value: object, option: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise SettingsError("expected action=key pairs", key=option)
    out = {}
    for action, binding in value.items():
        if not isinstance(action, str) or not _ACTION_RE.fullmatch(action):
            raise SettingsError(f"not an action name: {action!r}", key=option)
        try:
            out[action] = _binding(binding)
        except ValueError as exc:
            raise SettingsError(str(exc), key=option) from None
    return out


def _coerce(name: str, value: object) -> object:
    """Turn a command-line string into the type the check expects; leave the rest to it."""
    if not isinstance(value, str):
        return value
    check = _FIELD_CHECKS[name]
    try:
        if check in (_temperature, _top_p):
            return float(value)
        if check in (_top_k, _seed, _max_tokens, _speculative):
            return int(value, 10)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None
    if check is _boolean:
        lowered = value.lower()
        if lowered in ("true", "on", "yes", "1"):
            return True
        if lowered in ("false", "off", "no", "0"):
            return False
    return value


def _with_values(settings: Settings, values: Mapping[str, Any]) -> Settings:
    return dataclasses.replace(settings, **values)
