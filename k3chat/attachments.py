"""Local files attached to a message: read, checked, turned into text, rendered into the message.

A file becomes an ``Attachment`` whose ``text`` is exactly what the model reads for it. Kinds:
plain text, Markdown, source code, CSV, TSV, JSON (checked: invalid JSON is attached as text,
with a note) and PDF (text extracted per page with pypdf; pages without extractable text are
named in ``notes``). Text files must be UTF-8; a UTF-8 BOM is dropped and a UTF-16 BOM is
honoured. Anything else is refused with an ``AttachmentError`` (exit 2) saying what is wrong
and what to do: a missing file, a directory or other non-regular file, a file we may not read,
a binary file (the offset of the byte that says so), an encrypted or broken PDF, an empty file
or a PDF without any text, and a file over MAX_FILE_BYTES (16 MiB: about 4 million tokens of
text, far past any context K3 can hold, so nothing that could fit is refused by it).

The rendered form (one per message, ``render_user_message``): each attachment, in order, then
the typed text::

    ==== attachment 1 of 2: "report.csv" (CSV, 1,204 bytes) ====
    <the attachment's text>
    ==== end of attachment 1 of 2: "report.csv" ====

    ==== attachment 2 of 2: ...
    ...
    ==== end of attachment 2 of 2: "..." ====

    <what the user typed>

The fence (``====``) is a run of ``=`` one longer than the longest run of ``=`` anywhere in the
message (attachment texts, names and the typed text), at least four: no line inside a document
can therefore equal a delimiter line, so a document cannot fake the end of its block or the
start of another. Names are JSON-quoted, so a name cannot hold a line break either. The form
depends only on what the history stores, so a session re-renders to the same prompt ids.

No Textual import here: the CLI, the app and the history all use this module.
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from k3engine.exit_codes import EXIT_USAGE

from .runtime import Failure

MAX_FILE_BYTES = 16 * 1024 * 1024
MIN_FENCE = 4

KINDS = ("text", "markdown", "code", "csv", "tsv", "json", "pdf")
KIND_LABELS = {"text": "plain text", "markdown": "Markdown", "code": "source code", "csv": "CSV", "tsv": "TSV",
               "json": "JSON", "pdf": "PDF"}

_EXTENSION_KINDS = {
    **dict.fromkeys(("txt", "text", "log", "rst", "org", ""), "text"),
    **dict.fromkeys(("md", "markdown", "mdown", "mkd"), "markdown"),
    "csv": "csv", "tsv": "tsv", "tab": "tsv",
    **dict.fromkeys(("json", "jsonl", "ndjson", "geojson"), "json"),
    "pdf": "pdf",
    **dict.fromkeys(("py", "pyi", "c", "h", "cc", "cpp", "cxx", "hpp", "hh", "rs", "go", "java", "kt", "kts", "scala",
                     "js", "mjs", "cjs", "ts", "tsx", "jsx", "rb", "php", "pl", "pm", "lua", "r", "jl", "swift",
                     "m", "mm", "cs", "fs", "hs", "ml", "mli", "ex", "exs", "erl", "clj", "lisp", "scm", "el", "vim",
                     "sh", "bash", "zsh", "fish", "ps1", "bat", "sql", "html", "htm", "css", "scss", "tcss", "xml",
                     "yaml", "yml", "toml", "ini", "cfg", "conf", "mk", "cmake", "gradle", "dockerfile", "tex",
                     "proto", "graphql", "zig", "nim", "d", "v", "sv", "vhd", "asm", "s", "patch", "diff"), "code"),
}
_CODE_NAMES = {"makefile", "dockerfile", "cmakelists.txt", "gemfile", "rakefile", "justfile"}
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_EQUALS_RE = re.compile(r"=+")


class AttachmentError(Failure):
    """A file that cannot be attached: the message says what is wrong and what to do (exit 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


class TextEncoder(Protocol):
    """What token counting needs of k3chat.tokenizer.Tokenizer."""

    def encode_text(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Attachment:
    name: str  # the file's base name, as shown and rendered
    path: str | None  # where it was read from (None once loaded from the history: not stored)
    size: int  # bytes of the file
    sha256: str  # of the file's bytes, hex
    kind: str  # one of KINDS
    text: str  # exactly what the model reads for it
    notes: tuple[str, ...] = ()  # e.g. which PDF pages had no extractable text

    @property
    def label(self) -> str:
        """The kind in words, e.g. "source code (.py)"."""
        label = KIND_LABELS[self.kind]
        suffix = Path(self.name).suffix
        return f"{label} ({suffix})" if self.kind == "code" and suffix else label

    def to_record(self) -> dict[str, Any]:
        """The history's form: everything but the path (the session stays self-contained)."""
        return {"name": self.name, "size": self.size, "sha256": self.sha256, "kind": self.kind,
                "notes": list(self.notes), "text": self.text}

    @classmethod
    def from_record(cls, entry: Mapping[str, Any]) -> Attachment:
        return cls(name=entry["name"], path=None, size=entry["size"], sha256=entry["sha256"], kind=entry["kind"],
                   text=entry["text"], notes=tuple(entry.get("notes", ())))


# --------------------------------------------------------------------------- reading


def read_attachment(path: str | Path) -> Attachment:
    """The file at ``path`` as an Attachment, or an AttachmentError saying why not."""
    given = Path(path).expanduser()
    shown = str(path)
    data = _read_bytes(given, shown)
    kind = kind_for(given)
    if kind == "pdf" or data.startswith(b"%PDF-"):
        text, notes = _pdf_text(data, shown)
        kind = "pdf"
    else:
        text, notes = _decoded(data, shown)
        if kind == "json" and given.suffix.lower() == ".json":
            notes += _json_notes(text)
    return Attachment(name=given.name, path=str(given.resolve()), size=len(data),
                      sha256=hashlib.sha256(data).hexdigest(), kind=kind, text=text, notes=tuple(notes))


def read_text_file(path: str | Path, option: str) -> str:
    """A text file given with ``option`` (e.g. --prompt-file), checked like an attachment."""
    given = Path(path).expanduser()
    text, _ = _decoded(_read_bytes(given, str(path), f"read the {option}"), str(path), f"read the {option}")
    return text


def kind_for(path: Path) -> str:
    """The kind a file's name says (an unknown extension is plain text: its bytes decide)."""
    if path.name.lower() in _CODE_NAMES:
        return "code"
    return _EXTENSION_KINDS.get(path.suffix.lower().lstrip("."), "text")


def _read_bytes(path: Path, shown: str, verb: str = "attach") -> bytes:
    try:
        st = path.stat()  # before open: a FIFO or a device would block or never end
    except FileNotFoundError:
        raise AttachmentError(f"cannot {verb} {shown}: no such file (relative paths are from {os.getcwd()}); "
                              "check the path") from None
    except PermissionError:
        raise AttachmentError(f"cannot {verb} {shown}: permission denied on a directory in its path; "
                              "check the permissions (ls -ld) or copy the file somewhere you can read") from None
    except OSError as exc:
        raise AttachmentError(f"cannot {verb} {shown}: {exc.strerror or exc}; check the path") from None
    if stat.S_ISDIR(st.st_mode):
        raise AttachmentError(f"cannot {verb} {shown}: it is a directory; attach the files in it one by one")
    if not stat.S_ISREG(st.st_mode):
        raise AttachmentError(f"cannot {verb} {shown}: it is not a regular file (a device, pipe or socket); "
                              "save what it holds to a file and attach that")
    _check_size(st.st_size, shown, verb)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except PermissionError:
        raise AttachmentError(f"cannot {verb} {shown}: permission denied; check its permissions (ls -l) "
                              "or copy it somewhere you can read") from None
    except OSError as exc:
        hint = "the disk may be failing" if exc.errno == errno.EIO else "check the file"
        raise AttachmentError(f"cannot {verb} {shown}: {exc.strerror or exc}; {hint}") from None
    _check_size(len(data), shown, verb)  # it may have grown since stat
    if not data:
        raise AttachmentError(f"cannot {verb} {shown}: the file is empty (0 bytes); there is nothing to read")
    return data


def _check_size(size: int, shown: str, verb: str = "attach") -> None:
    if size > MAX_FILE_BYTES:
        raise AttachmentError(f"cannot {verb} {shown}: it is {size / 2**20:,.1f} MiB and files are limited "
                              f"to {MAX_FILE_BYTES // 2**20} MiB each (far more than any context holds); "
                              "attach the part you want to ask about")


_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def _decoded(data: bytes, shown: str, verb: str = "attach") -> tuple[str, list[str]]:
    """The text of a text file (UTF-8, or UTF-16 with its BOM), else why it is binary."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            body, offset = data[len(bom):], len(bom)
            break
    else:
        body, offset, encoding = data, 0, "utf-8"
    if encoding == "utf-8" and b"\x00" in body:
        at = body.index(b"\x00") + offset
        raise AttachmentError(f"cannot {verb} {shown}: it looks binary (a NUL byte at offset {at:,}); "
                              + ("only text files (UTF-8) and PDFs can be attached" if verb == "attach"
                                 else "give a UTF-8 text file"))
    try:
        text = body.decode(encoding)
    except UnicodeDecodeError as exc:
        at = exc.start + offset
        raise AttachmentError(f"cannot {verb} {shown}: it is not {encoding.upper()} text (byte 0x{body[exc.start]:02x} "
                              f"at offset {at:,} cannot be decoded); if it is text in another encoding, convert it "
                              f"(e.g. iconv -f LATIN1 -t UTF-8 {shown} > copy.txt) and attach the copy") from None
    if "\x00" in text:
        raise AttachmentError(f"cannot {verb} {shown}: it holds NUL characters, so it is not text")
    if not text:
        raise AttachmentError(f"cannot {verb} {shown}: it holds nothing but a byte-order mark")
    notes = [] if encoding == "utf-8" else [f"decoded from {encoding.upper()} (byte-order mark)"]
    return text, notes


def _json_notes(text: str) -> list[str]:
    try:
        json.loads(text)
    except ValueError as exc:
        return [f"not valid JSON ({exc}); attached as it is"]
    return []


def _pdf_text(data: bytes, shown: str) -> tuple[str, list[str]]:
    """Each page's text under a "[page N]" line; notes name the pages that had none."""
    verb = "attach"
    import io

    from pypdf import PdfReader

    what_to_do = "save it again from its viewer (print to PDF) or export its text, and attach that"
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and not reader.decrypt(""):
            raise AttachmentError(f"cannot {verb} {shown}: the PDF is encrypted with a password; save a decrypted "
                                  "copy (e.g. qpdf --decrypt --password=... in.pdf out.pdf) and attach that")
        pages = [page.extract_text() or "" for page in reader.pages]
    except AttachmentError:
        raise
    except Exception as exc:  # a hostile or broken file can make the parser raise anything
        raise AttachmentError(f"cannot {verb} {shown}: the PDF cannot be read ({type(exc).__name__}: {exc}); "
                              f"{what_to_do}") from None
    if not pages:
        raise AttachmentError(f"cannot {verb} {shown}: the PDF has no pages")
    empty = [n for n, text in enumerate(pages, start=1) if not text.strip()]
    if len(empty) == len(pages):
        raise AttachmentError(f"cannot {verb} {shown}: none of its {len(pages)} page(s) has extractable text "
                              "(a scan or images?); run it through OCR first, or attach its text")
    text = "\n\n".join(f"[page {n}]\n{page.strip(chr(10)) if page.strip() else '(no extractable text)'}"
                       for n, page in enumerate(pages, start=1)).replace("\x00", "")
    notes = [f"{_pages(empty)} of {len(pages)} had no extractable text (a scan or images?)"] if empty else []
    return text, notes


def _pages(numbers: Sequence[int]) -> str:
    return ("page " if len(numbers) == 1 else "pages ") + ", ".join(str(n) for n in numbers)


# --------------------------------------------------------------------------- rendering


def fence_for(text: str, attachments: Sequence[Attachment]) -> str:
    """A run of '=' longer than any in the message: no line of a document can equal it."""
    parts = [text, *(a.text for a in attachments), *(_quoted(a.name) for a in attachments)]
    longest = max((len(m.group()) for part in parts for m in _EQUALS_RE.finditer(part)), default=0)
    return "=" * max(MIN_FENCE, longest + 1)


def _quoted(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def render_user_message(text: str, attachments: Sequence[Attachment]) -> str:
    """The user message the model reads: the attachments (see the module docstring), then
    ``text``. Without attachments it is ``text`` itself."""
    if not attachments:
        return text
    fence = fence_for(text, attachments)
    total = len(attachments)
    blocks = []
    for number, a in enumerate(attachments, start=1):
        which = f"attachment {number} of {total}: {_quoted(a.name)}"
        blocks.append(f"{fence} {which} ({a.label}, {a.size:,} bytes) {fence}\n{a.text}\n"
                      f"{fence} end of {which} {fence}")
    return "\n\n".join(blocks) + ("\n\n" + text if text else "")


def token_count(attachment: Attachment, tokenizer: TextEncoder) -> int:
    """Tokens the attachment adds to a message, delimiters included (as rendered alone)."""
    return len(tokenizer.encode_text(render_user_message("", [attachment])))


def record_attachments(record: Mapping[str, Any]) -> list[Attachment]:
    """The attachments of a (valid) history record."""
    return [Attachment.from_record(entry) for entry in record.get("attachments") or ()]


def model_message(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """``record`` as the template and a server see it: a user record's attachments rendered
    into its content (other records as they are)."""
    if record.get("role") != "user" or not record.get("attachments"):
        return record
    out = {k: v for k, v in record.items() if k != "attachments"}
    out["content"] = render_user_message(str(record.get("content", "")), record_attachments(record))
    return out


# --------------------------------------------------------------------------- validation


_ENTRY_KEYS = ("name", "size", "sha256", "kind", "notes", "text")


def attachments_problem(value: object) -> str | None:
    """Why a history record's ``attachments`` value is malformed, or None."""
    if not isinstance(value, list) or not value:
        return "attachments must be a non-empty list"
    for number, entry in enumerate(value, start=1):
        problem = _entry_problem(entry)
        if problem is not None:
            return f"attachment {number}: {problem}"
    return None


def _entry_problem(entry: object) -> str | None:
    if not isinstance(entry, dict):
        return "must be an object"
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        return f"unknown field {unknown[0]!r}"
    missing = [key for key in _ENTRY_KEYS if key not in entry]
    if missing:
        return f"{missing[0]} is missing"
    name, size, digest, kind, notes, text = (entry[key] for key in _ENTRY_KEYS)
    if not isinstance(name, str) or not name or not _is_text(name):
        return "name must be a non-empty string"
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return "size must be a byte count"
    if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
        return "sha256 must be 64 lowercase hex digits"
    if kind not in KINDS:
        return f"kind must be one of {', '.join(KINDS)}, got {kind!r}"
    if not isinstance(notes, list) or not all(isinstance(n, str) and _is_text(n) for n in notes):
        return "notes must be a list of strings"
    if not isinstance(text, str) or not _is_text(text):
        return "text must be a string"
    return None


def _is_text(value: str) -> bool:
    """Storable as UTF-8 (no unpaired surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


__all__ = ["Attachment", "AttachmentError", "read_attachment", "render_user_message", "token_count", "fence_for",
           "model_message", "record_attachments", "attachments_problem", "kind_for", "read_text_file", "KINDS", "MAX_FILE_BYTES"]
