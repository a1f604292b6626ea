"""One configuration surface: every TORCH_COMMOPT_* environment variable is read in core/env.py,
read at call time, and listed in docs/configuration.md.  CPU only, no process group."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from torch_commopt.core import env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torch_commopt"
ENV_MODULE = PACKAGE / "core" / "env.py"
# Modules that may touch os.environ for another reason: the test launcher hands the caller's
# environment to its rank processes and sets the rendezvous variables; it reads no option.
ENVIRON_ALLOWED = {PACKAGE / "testing" / "launch.py"}
ENVIRON_NAMES = {"environ", "getenv", "putenv", "unsetenv", "environb", "getenvb"}


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p != ENV_MODULE)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the bare string statements (docstrings and string comments)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def test_only_core_env_names_a_torch_commopt_variable_in_code():
    """Outside core/env.py a TORCH_COMMOPT_ name appears in docstrings and comments only: code
    refers to it through env's constants and reads it through env's accessors."""
    offenders = []
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        prose = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                    and "TORCH_COMMOPT_" in node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "read TORCH_COMMOPT_* variables through torch_commopt/core/env.py:\n" + "\n".join(offenders)


def test_only_core_env_reads_the_environment():
    offenders = []
    for path in _modules():
        if path in ENVIRON_ALLOWED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in ENVIRON_NAMES:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
            if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                    any(a.name in ENVIRON_NAMES for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from os import ...")
    assert not offenders, "read environment variables through torch_commopt/core/env.py:\n" + "\n".join(offenders)


def test_env_names_every_variable_it_reads():
    mentioned = set(re.findall(r"TORCH_COMMOPT_[A-Z0-9_]+", ENV_MODULE.read_text()))
    assert mentioned == set(env.NAMES)
    assert len(env.NAMES) == len(set(env.NAMES))


def test_every_variable_is_in_the_configuration_reference():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in env.NAMES if f"`{name}`" not in doc]
    assert not missing, f"docs/configuration.md does not list {missing}"


def test_every_config_field_is_in_the_configuration_reference():
    import dataclasses

    from torch_commopt.config import Config

    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(Config) if f"| `{f.name}` |" not in doc]
    assert not missing, f"docs/configuration.md does not list Config fields {missing}"


@pytest.mark.parametrize("accessor,name,cases", [
    (env.debug_waits, env.DEBUG_WAITS,
     {None: False, "": False, "0": False, "false": False, "False": False, "1": True, "yes": True}),
    (env.shared_device, env.SHARED_DEVICE, {None: False, "": False, "0": False, "1": True, "false": True}),
    (env.call_graphs, env.CALL_GRAPHS,
     {None: True, "": True, "1": True, "0": False, "false": False, "False": False, "off": False}),
    (env.host_timing, env.HOST_TIMING, {None: False, "": False, "0": False, "1": True, "true": False}),
    (env.attention_lane, env.ATTENTION_LANE, {None: False, "0": False, "1": True, "on": False}),
    (env.attention_transport, env.ATTENTION_TRANSPORT, {None: "auto", "": "auto", " CE ": "ce", "x": "x"}),
    (env.attention_a2a, env.ATTENTION_A2A, {None: "ce", "": "ce", "NCCL": "nccl"}),
    (env.attention_group_streams, env.ATTENTION_GROUP_STREAMS, {None: "1", " ": "1", "Fwd": "fwd", "0": "0"}),
    (env.wait_timeout_s, env.WAIT_TIMEOUT_S, {None: 60.0, "": 60.0, "5": 5.0, " 0.5 ": 0.5}),
    (env.watchdog, env.WATCHDOG, {None: True, "": True, "1": True, "0": False, "off": False, "False": False}),
])
def test_each_variable_is_read_at_call_time(monkeypatch, accessor, name, cases):
    for value, want in cases.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert accessor() == want, (name, value)


@pytest.mark.parametrize("text", ["0", "-3", "nan", "inf", "soon"])
def test_a_wait_timeout_that_is_not_a_positive_finite_number_is_refused(monkeypatch, text):
    monkeypatch.setenv(env.WAIT_TIMEOUT_S, text)
    with pytest.raises(ValueError, match=env.WAIT_TIMEOUT_S):
        env.wait_timeout_s()


def test_cache_dir_falls_back_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "c"))
    assert env.cache_dir() == tmp_path / "c"
    monkeypatch.setenv(env.CACHE_DIR, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert env.cache_dir() == tmp_path / "x" / "torch_commopt"
    monkeypatch.delenv(env.CACHE_DIR)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert env.cache_dir() == tmp_path / "h" / ".cache" / "torch_commopt"


def test_env_is_a_leaf():
    tree = ast.parse(ENV_MODULE.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.startswith("torch_commopt") for m in imported)


def test_a_switch_read_on_every_call_follows_os_environ_replaced_whole(monkeypatch):
    """env's per-call switches read os.environ's own encoded mapping; a test or launcher that puts
    another mapping in its place is followed, not the first one."""
    import os

    monkeypatch.setenv(env.WATCHDOG, "0")
    assert env.watchdog() is False
    monkeypatch.setattr(os, "environ", {env.WATCHDOG: "1"})  # a plain dict: read through .get
    assert env.watchdog() is True


@pytest.mark.parametrize("watchdog, debug, watched", [(None, None, True), ("0", None, False), ("off", "", False),
                                                      (None, "1", False), ("1", "0", True), ("", "false", True)])
def test_a_call_is_watched_when_the_watchdog_is_on_and_waits_are_not_bounded_by_debug_mode(
        monkeypatch, watchdog, debug, watched):
    """watch_calls, read at every GPU call's start, agrees with the two switches it stands for."""
    for name, value in ((env.WATCHDOG, watchdog), (env.DEBUG_WAITS, debug)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert env.watch_calls() is watched
    assert env.watch_calls() is (env.watchdog() and not env.debug_waits())
