"""Settings: defaults, a full file, errors naming key and line, CLI precedence."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from k3chat.settings import Settings, SettingsError, load_settings, merge_cli

FULL = """\
# k3chat settings
model = "~/models/kimi-k3"
memory = "12G"
max_tokens = 2048
theme = "paper"

[thinking]
enabled = false
effort = "low"
display = "hidden"

[sampler]
temperature = 0.6
top_p = 0.9
top_k = 40
seed = 7

[keys]
quit = "ctrl+q"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(textwrap.dedent(text))
    return path


def error(tmp_path: Path, text: str) -> SettingsError:
    with pytest.raises(SettingsError) as info:
        load_settings(write(tmp_path, text))
    return info.value


def test_missing_file_gives_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path))
    s = load_settings()
    assert s == Settings()
    assert (s.effort, s.thinking, s.sampling, s.top_p, s.max_tokens, s.memory) == ("max", True, False, 0.95, 4096, "auto")


def test_default_path_is_the_platform_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text('theme = "night"\n')
    assert load_settings().theme == "night"


def test_full_file(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, FULL))
    assert s.model == Path("~/models/kimi-k3").expanduser()
    assert (s.memory, s.max_tokens, s.theme) == ("12G", 2048, "paper")
    assert (s.thinking, s.effort, s.reasoning_display) == (False, "low", "hidden")
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.6, 0.9, 40, 7)
    assert s.sampling is True  # implied by the sampler values (spec 4)
    assert s.keys == {"quit": "ctrl+q"}


def test_explicit_greedy_wins_over_implied_sampling(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, "[sampler]\nsampling = false\ntemperature = 0.5\n"))
    assert (s.sampling, s.temperature) == (False, 0.5)


@pytest.mark.parametrize("memory", ["12G", "512m", "1.5T", "64GiB", "auto", "AUTO", "medium"])
def test_memory_forms(tmp_path: Path, memory: str) -> None:
    assert load_settings(write(tmp_path, f'memory = "{memory}"\n')).memory


def test_unknown_key_names_key_and_line(tmp_path: Path) -> None:
    e = error(tmp_path, """\
        theme = "paper"

        [sampler]
        top_p = 0.9
        temprature = 0.5
        """)
    assert (e.key, e.line) == ("sampler.temprature", 5)
    assert "line 5" in str(e) and "sampler.temprature" in str(e) and "sampler.temperature" in str(e)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    e = error(tmp_path, 'theme = "x"\ncolour = "red"\n')
    assert (e.key, e.line) == ("colour", 2)


def test_wrong_type_names_key_and_line(tmp_path: Path) -> None:
    e = error(tmp_path, '[thinking]\neffort = "max"\nenabled = "yes"\n')
    assert (e.key, e.line) == ("thinking.enabled", 3)
    assert "true or false" in str(e)


@pytest.mark.parametrize("text, key, line", [
    ('[thinking]\neffort = "medium"\n', "thinking.effort", 2),
    ('[thinking]\ndisplay = "sometimes"\n', "thinking.display", 2),
    ("[sampler]\ntemperature = 0\n", "sampler.temperature", 2),
    ("[sampler]\ntemperature = nan\n", "sampler.temperature", 2),
    ("[sampler]\ntemperature = true\n", "sampler.temperature", 2),
    ("[sampler]\ntop_p = 0.0\n", "sampler.top_p", 2),
    ("[sampler]\ntop_p = 1.5\n", "sampler.top_p", 2),
    ("[sampler]\n\ntop_k = -1\n", "sampler.top_k", 3),
    ("[sampler]\ntop_k = 2.5\n", "sampler.top_k", 2),
    ("[sampler]\nseed = -1\n", "sampler.seed", 2),
    ('memory = "12"\n', "memory", 1),
    ("memory = 12\n", "memory", 1),
    ('memory = "lots"\n', "memory", 1),
    ("max_tokens = 0\n", "max_tokens", 1),
    ('theme = "a b"\n', "theme", 1),
    ('model = ""\n', "model", 1),
    ("sampler = 3\n", "sampler", 1),
    ('[keys]\nquit = "ctrl q"\n', "keys.quit", 2),
    ('theme = "x"\nsampler.top_p = 2\n', "sampler.top_p", 2),  # dotted key
    ('theme = "x"\nsampler = { top_k = -3 }\n', "sampler.top_k", 2),  # inline table
])
def test_bad_values_name_key_and_line(tmp_path: Path, text: str, key: str, line: int) -> None:
    e = error(tmp_path, text)
    assert (e.key, e.line) == (key, line)
    assert f"line {line}" in str(e) and key in str(e)


def test_toml_syntax_error_has_its_line(tmp_path: Path) -> None:
    e = error(tmp_path, 'theme = "x"\n\n[sampler\ntop_k = 1\n')
    assert e.line == 3 and "not valid TOML" in str(e)


def test_invalid_utf8_has_its_line(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'theme = "x"\n# caf\xe9\n')
    with pytest.raises(SettingsError) as info:
        load_settings(path)
    assert info.value.line == 2


def test_cli_overrides_the_file(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, FULL))
    merged = merge_cli(s, {"effort": "max", "thinking": True, "memory": "auto", "theme": None,
                           "top_k": "5", "keys": {"help": "f1"}})
    assert (merged.effort, merged.thinking, merged.memory, merged.top_k) == ("max", True, "auto", 5)
    assert merged.theme == "paper"  # None means "not given on the command line"
    assert merged.keys == {"quit": "ctrl+q", "help": "f1"}
    assert s.effort == "low"  # the original is untouched


def test_cli_sampler_value_implies_sampling_unless_told(tmp_path: Path) -> None:
    greedy_file = load_settings(write(tmp_path, "[sampler]\nsampling = false\n"))
    assert merge_cli(greedy_file, {"temperature": 0.7}).sampling is True
    assert merge_cli(greedy_file, {"temperature": 0.7, "sampling": False}).sampling is False
    sampling_file = load_settings(write(tmp_path, "[sampler]\nseed = 1\n"))
    assert merge_cli(sampling_file, {"sampling": "off"}).sampling is False


@pytest.mark.parametrize("overrides, key", [
    ({"top_p": 0}, "--top-p"),
    ({"temperature": "warm"}, "--temperature"),
    ({"effort": "medium"}, "--effort"),
    ({"memory": "12"}, "--memory"),
    ({"colour": "red"}, "--colour"),
    ({"keys": {"quit": ""}}, "--keys"),
])
def test_cli_values_are_checked(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(SettingsError) as info:
        merge_cli(Settings(), overrides)
    assert info.value.key == key and key in str(info.value)


def test_chat_core_modules_do_not_import_textual() -> None:
    code = ("import sys, k3chat.paths, k3chat.history, k3chat.statefile, k3chat.settings;"
            "sys.exit('textual' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
