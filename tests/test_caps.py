"""The width cap's precedence, values, user config round trip and TOML writer."""

import datetime as dt
import os
import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gmlx.policy import user_config
from gmlx.policy.caps import CapDecision, resolve_cap
from gmlx.policy.user_config import machine_key, read_user_entry, write_cap
from gmlx.policy.toml_write import dumps_toml
from gmlx.errors import ConfigError

M = "test-machine-2c-openblas"


@pytest.fixture(autouse=True)
def cfg(tmp_path, monkeypatch):
    """Every test gets its own config file; the real user config is never read or written."""
    path = tmp_path / "conf" / "config.toml"
    monkeypatch.setenv("GMLX_CONFIG", str(path))
    return path


def resolve(cli=None, env=None, default=None, key="gmlx-default"):
    return resolve_cap(cli_cap=cli, env_cap=env, model_key=key, model_default=default, machine=M)


@pytest.mark.parametrize(
    "cli, env, user, default, cap, source",
    [
        (3, 5, 7, 9, 3, "cli"),
        (None, 5, 7, 9, 5, "env GMLX_MTP_WIDTH_CAP"),
        (None, None, 7, 9, 7, "user config"),
        (None, None, None, 9, 9, "model default"),
        (None, None, None, None, 0, "built-in default"),
        (0, 5, 7, 9, 0, "cli"),  # 0 is a value (uncapped), not "unset"
        (None, 0, 7, 9, 0, "env GMLX_MTP_WIDTH_CAP"),
        (None, None, 0, 9, 0, "user config"),
        (None, None, "off", 9, None, "user config"),
        (None, 2, "off", 9, 2, "env GMLX_MTP_WIDTH_CAP"),
        ("off", 2, 7, 9, None, "cli"),
        (None, None, None, "off", None, "model default"),
    ],
)
def test_precedence(cfg, cli, env, user, default, cap, source):
    if user is not None:
        write_cap("gmlx-default", user, machine=M)
    d = resolve(cli, env, default)
    assert d.cap == cap
    assert d.source.startswith(source)
    if source == "user config":
        assert d.source == f"user config {cfg}"


def test_user_config_is_per_model_and_machine(cfg):
    write_cap("gmlx-default", 4, machine=M)
    assert resolve(key="/models/other").source == "built-in default"
    d = resolve_cap(cli_cap=None, env_cap=None, model_key="gmlx-default", model_default=None, machine="other")
    assert d.source == "built-in default"


def test_allows():
    capped = CapDecision(cap=4, source="t")
    assert [capped.allows(w) for w in (1, 2, 4, 5, 64)] == [True, True, True, False, False]
    assert all(CapDecision(cap=0, source="t").allows(w) for w in (1, 2, 1000))
    assert not any(CapDecision(cap=None, source="t").allows(w) for w in (1, 2, 1000))
    assert CapDecision(cap=1, source="t").allows(1) and not CapDecision(cap=1, source="t").allows(2)
    with pytest.raises(ValueError):
        capped.allows(0)


def test_zero_and_off_are_distinct(cfg):
    write_cap("gmlx-default", 0, machine=M)
    zero = resolve(default=4)
    write_cap("gmlx-default", "off", machine=M)
    off = resolve(default=4)
    assert (zero.cap, off.cap) == (0, None)
    assert zero.allows(8) and not off.allows(2)
    assert (zero.text, off.text) == ("0 = uncapped", "off")
    assert tomllib.loads(cfg.read_text())["models"]["gmlx-default"][M]["speculative_width_cap"] == "off"


def test_round_trip_with_k_by_width(cfg):
    assert write_cap("gmlx-default", 4, k_by_width={1: 3, 2: 3, 4: 2}, machine=M) == cfg
    e = read_user_entry("gmlx-default", machine=M)
    assert e.cap == 4 and e.k_by_width == ((1, 3), (2, 3), (4, 2)) and e.source == "sweep-cap"
    assert dt.datetime.fromisoformat(e.measured_at).tzinfo is not None
    d = resolve(cli=2)  # K comes from the user config whatever sets the cap
    assert [d.num_draft_tokens(w, default=5) for w in (1, 2, 3, 4, 8)] == [3, 3, 3, 2, 2]
    assert CapDecision(cap=0, source="t").num_draft_tokens(4, default=5) == 5
    assert CapDecision(cap=0, source="t", k_by_width=((2, 1),)).num_draft_tokens(1, default=5) == 5


def test_write_preserves_other_entries_and_replaces_own(cfg):
    cfg.parent.mkdir(parents=True)
    cfg.write_text(
        'theme = "dark"\n'
        '[models."/m/a"."other-machine"]\nspeculative_width_cap = 2\nsource = "hand"\n'
        '[models."/m/b".' + M + ']\nspeculative_width_cap = "off"\n'
        '[[extras]]\nx = 1.5\n[[extras]]\nwhen = 2024-05-01T10:00:00Z\n'
    )
    before = tomllib.loads(cfg.read_text())
    write_cap("/m/a", 8, machine=M, source="test")
    write_cap("/m/a", 6, machine=M, source="test")  # replaces its own entry
    after = tomllib.loads(cfg.read_text())
    mine = after["models"]["/m/a"].pop(M)
    assert mine["speculative_width_cap"] == 6 and mine["source"] == "test"
    assert after == before
    assert not [p for p in cfg.parent.iterdir() if p.name != cfg.name]  # no temp files left


def test_write_creates_directories(tmp_path):
    target = tmp_path / "a" / "b" / "config.toml"
    write_cap("gmlx-default", 3, machine=M, path=target)
    assert read_user_entry("gmlx-default", machine=M, path=target).cap == 3


def test_write_through_symlink(tmp_path):
    real = tmp_path / "dotfiles" / "config.toml"
    real.parent.mkdir()
    real.write_text('keep = 1\n')
    link = tmp_path / "config.toml"
    link.symlink_to(real)
    write_cap("gmlx-default", 3, machine=M, path=link)
    assert link.is_symlink() and tomllib.loads(real.read_text())["keep"] == 1


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("models = [", "not valid TOML"),
        ('[models."gmlx-default".' + M + "]\nspeculative_width_cap = -1\n", "speculative_width_cap = -1"),
        ('[models."gmlx-default".' + M + "]\nspeculative_width_cap = true\n", '"off"'),
        ('[models."gmlx-default".' + M + "]\nspeculative_width_cap = 2.5\n", ">= 0"),
        ('[models."gmlx-default".' + M + ']\nspeculative_width_cap = "never"\n', "invalid"),
        ('[models."gmlx-default".' + M + "]\nspeculative_width_caps = 2\n", "unknown key"),
        ('[models."gmlx-default".' + M + "]\nnum_draft_tokens_by_width = {x = 2}\n", "num_draft_tokens_by_width"),
        ('[models."gmlx-default".' + M + "]\nnum_draft_tokens_by_width = {1 = -1}\n", "integers >= 0"),
        ('[models."gmlx-default".' + M + "]\nsource = 3\n", "must be a string"),
        ("models = 3\n", "must be a table"),
        ('[models]\n"gmlx-default" = 1\n', "must be a table"),
    ],
)
def test_bad_config_is_a_config_error(cfg, text, fragment):
    cfg.parent.mkdir(parents=True)
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        resolve()
    assert str(cfg) in str(info.value) and fragment in str(info.value)


def test_bad_file_is_never_overwritten(cfg):
    cfg.parent.mkdir(parents=True)
    cfg.write_text("models = [")
    with pytest.raises(ConfigError):
        write_cap("gmlx-default", 2, machine=M)
    assert cfg.read_text() == "models = ["


@pytest.mark.parametrize("bad", [-1, True, 1.5, "none"])
def test_bad_values_rejected(bad):
    with pytest.raises(ConfigError):
        write_cap("gmlx-default", bad, machine=M)
    with pytest.raises(ConfigError):
        resolve(cli=bad)
    with pytest.raises(ConfigError):
        write_cap("gmlx-default", 2, k_by_width={2: bad}, machine=M)


def test_edit_is_seen_without_restart(cfg):
    write_cap("gmlx-default", 2, machine=M)
    assert resolve().cap == 2
    cfg.write_text(cfg.read_text().replace("speculative_width_cap = 2", "speculative_width_cap = 5"))
    os.utime(cfg, ns=(0, 10**9))  # a new stamp even on a coarse-mtime filesystem
    assert resolve().cap == 5


def test_config_path(monkeypatch, tmp_path):
    monkeypatch.delenv("GMLX_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert user_config.config_path() == tmp_path / "gmlx" / "config.toml"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/dir")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_config.config_path() == tmp_path / "home" / ".config" / "gmlx" / "config.toml"


def test_machine_key_is_stable_and_tidy():
    key = machine_key()
    assert key == machine_key()
    assert key.replace("-", "").isalnum() and key == key.lower()
    assert f"-{os.cpu_count()}c-" in key
    assert key.endswith(("openblas", "refblas", "metal", "default"))


def test_model_key(tmp_path):
    from gmlx.models.loading import default_model_path

    assert user_config.model_key(None) == user_config.model_key(default_model_path()) == "gmlx-default"
    assert user_config.model_key(tmp_path / "x" / ".." / "m") == str((tmp_path / "m").resolve())


def test_str_of_decision():
    assert str(CapDecision(cap=4, source="cli")) == "4 (cli)"


_keys = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
_leaves = (
    st.integers(-(2**63), 2**63 - 1) | st.booleans() | st.floats(allow_nan=False)
    | st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
    | st.dates(dt.date(1970, 1, 1), dt.date(2100, 1, 1))
    | st.datetimes(dt.datetime(1970, 1, 1), dt.datetime(2100, 1, 1), timezones=st.none() | st.just(dt.timezone.utc))
)
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
                       max_leaves=12)


@given(st.dictionaries(_keys, _values, max_size=5))
def test_toml_writer_round_trips(data):
    assert tomllib.loads(dumps_toml(data)) == data


def test_toml_writer_layout():
    text = dumps_toml({"models": {"/a b": {M: {"speculative_width_cap": 4,
                                                "num_draft_tokens_by_width": {"1": 3, "4": 2}}}}})
    assert text == f'[models."/a b".{M}]\nspeculative_width_cap = 4\nnum_draft_tokens_by_width = {{1 = 3, 4 = 2}}\n'
