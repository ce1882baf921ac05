"""A bad ``DataStatesIO`` setting given to ``examples/cli.py`` (LightningCLI) is told by the plugin's own validation as
the last line of a short error, not in the middle of jsonargparse's 77 to 97 lines about every plugin type it tried.

Each case runs the example as a user would, in a subprocess, from the command line or from a yaml file; the plugin's
message names the setting and the fix (the closest name for a misspelt one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_datastates.lightning_cli import explain_parse_error

ROOT = Path(__file__).resolve().parents[1]
#: Most lines the error may take: jsonargparse's short usage, its tip, and the one line that matters (plus the two
#: lines of "Seed set to 0" Lightning prints before an instantiation).
MAX_LINES = 6


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "cli.py"),
            "fit",
            "--config",
            str(ROOT / "configs" / "local.yaml"),
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _yaml(tmp_path: Path, line: str) -> str:
    path = tmp_path / "plugin.yaml"
    path.write_text(
        f"trainer:\n  plugins:\n    - class_path: lightning_datastates.DataStatesIO\n      init_args:\n        {line}\n"
    )
    return str(path)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            ["--trainer.plugins.init_args.host_cach=4GiB"],
            "error: trainer.plugins: DataStatesIO has no setting 'host_cach': did you mean 'host_cache'?",
        ),
        (
            ["yaml", "writer_threads: four"],
            "error: trainer.plugins: writer_threads must be an int from 1 to 256, got 'four'",
        ),
        (
            ["--trainer.plugins.init_args.writer_threads=four"],
            "writer_threads must be an int from 1 to 256, got 'four'",
        ),
        (["yaml", "host_cache: 4 gigs"], "error: trainer.plugins: host_cache='4 gigs' is not a size: use bytes (4096)"),
        (["--trainer.plugins.init_args.host_cache=4 gigs"], "host_cache='4 gigs' is not a size"),
    ],
    ids=["typo-cli", "four-yaml", "four-cli", "gigs-yaml", "gigs-cli"],
)
def test_a_bad_plugin_setting_is_the_last_line_of_a_short_error(tmp_path, given, expected):
    args = ["--config", _yaml(tmp_path, given[1])] if given[0] == "yaml" else given
    result = _cli(tmp_path, *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in lines[-1], result.stderr
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{result.stderr}"
    assert not (tmp_path / "checkpoints").exists()  # nothing ran


def test_other_errors_keep_jsonargparse_s_message(tmp_path):
    result = _cli(tmp_path, "--trainer.max_stepz=3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: unrecognized arguments: --trainer.max_stepz=3"


def test_explain_parse_error_ignores_other_problems():
    assert explain_parse_error("Parser key \"trainer.max_steps\":\n  Expected a <class 'int'>. Got value: x") is None
    # A problem of the plugin's that our validation does not explain: jsonargparse's own report stands.
    message = "Problem with given class_path 'lightning_datastates.DataStatesIO':\n    Something else went wrong\n"
    assert explain_parse_error(message) is None
    message = (
        "Problem with given class_path 'lightning_datastates.DataStatesIO':\n"
        "            Parser key \"host_cache\":\n              Expected a <class 'str'>. Got value: 8GiB\n"
    )
    assert explain_parse_error(message) is None  # a value our validation accepts
