"""k3chat's themes (Textual's Theme API) and its stylesheet (package data in k3chat.themes).

The stylesheet uses only theme variables ($primary, $surface, ...), so any Textual theme
works with it; ``default`` in config.toml means ``k3-dark``.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources

from textual.theme import Theme

DEFAULT_THEME = "k3-dark"
STYLESHEET = "k3chat.tcss"

THEMES: tuple[Theme, ...] = (
    Theme(
        name="k3-dark",
        primary="#5FA8D3",
        secondary="#8FB3A8",
        accent="#D9A55B",
        warning="#D9A55B",
        error="#E06C6C",
        success="#8DBF7A",
        foreground="#D8DEE4",
        background="#111418",
        surface="#181C21",
        panel="#20262D",
        dark=True,
        variables={"footer-key-foreground": "#5FA8D3"},
    ),
    Theme(
        name="k3-light",
        primary="#1F5F8B",
        secondary="#3E6E62",
        accent="#9A5B00",
        warning="#9A5B00",
        error="#B3261E",
        success="#2E6B1F",
        foreground="#1C2126",
        background="#F7F7F4",
        surface="#EFEFEA",
        panel="#E2E4DE",
        dark=False,
    ),
)


def stylesheet() -> str:
    """The app's stylesheet, read from the installed package (works from a wheel too)."""
    return resources.files("k3chat.themes").joinpath(STYLESHEET).read_text(encoding="utf-8")


def resolve_theme(name: str, available: Iterable[str]) -> tuple[str, str | None]:
    """(theme to use, a warning or None) for the name in config.toml."""
    if name in ("default", ""):
        return DEFAULT_THEME, None
    if name in set(available):
        return name, None
    return DEFAULT_THEME, f"unknown theme {name!r}; using {DEFAULT_THEME}"
