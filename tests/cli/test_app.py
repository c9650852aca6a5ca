from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from kvrouter.cli import app, configure_logging

runner = CliRunner()


@pytest.fixture(autouse=True)
def _restore_logging():
    """configure_logging changes process-wide state; put it back for the tests that follow."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("kvrouter.test_component").setLevel(logging.NOTSET)


def test_version_lists_the_hot_path_libraries():
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0
    assert result.output.splitlines()[0].startswith("kvrouter ")
    assert "numba " in result.output


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "version" in result.output


def test_log_spec_sets_root_and_named_levels():
    configure_logging("error,kvrouter.test_component=debug")
    assert logging.getLogger().level == logging.ERROR
    assert logging.getLogger("kvrouter.test_component").level == logging.DEBUG


def test_unknown_log_level_is_a_usage_error():
    with pytest.raises(typer.BadParameter, match="bogus"):
        configure_logging("bogus")
    result = runner.invoke(app, ["--log", "bogus", "version"])
    assert result.exit_code == 2


def test_python_dash_m_runs_the_app():
    out = subprocess.run([sys.executable, "-m", "kvrouter", "version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("kvrouter ")
