"""The GPU scripts fit what a lent GPU machine allows, read from their text (no GPU here): every step of
``scripts/gpu_check.sh`` under its own timeout, together under 8 minutes, and at most 8 result files (the device
machine sends back no more)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
#: What one GPU check may take, and how many files come back from the device machine's output folder.
CHECK_LIMIT_S = 8 * 60
MAX_RESULT_FILES = 8


def _steps(script: str) -> list[tuple[str, str, int]]:
    """(name, log file, timeout) of each ``step NAME LOG TIMEOUT ...`` line."""
    return [(m[1], m[2], int(m[3])) for m in re.finditer(r"^(?:if ! )?step (\S+) (\S+) (\d+) ", script, re.MULTILINE)]


def test_every_gpu_check_step_has_a_timeout_and_all_fit_in_eight_minutes() -> None:
    script = (SCRIPTS / "gpu_check.sh").read_text()
    steps = _steps(script)
    assert len(steps) >= 7
    # Every command line of the script that runs Python is a step (under its timeout).
    runs = [line for line in script.splitlines() if re.match(r"^\s*(timeout \d+ )?python3 ", line)]
    assert runs == [], runs
    assert sum(limit for _, _, limit in steps) < CHECK_LIMIT_S


def test_gpu_check_writes_at_most_eight_result_files() -> None:
    script = (SCRIPTS / "gpu_check.sh").read_text()
    logs = {log for _, log, _ in _steps(script)}
    copied = set(re.findall(r'"\$out/([\w.-]+)"', script)) - logs
    assert len(logs | copied) <= MAX_RESULT_FILES, sorted(logs | copied)


def test_the_gpu_scripts_parse() -> None:
    for name in ("gpu_check.sh", "gpu_regimes.sh"):
        result = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
