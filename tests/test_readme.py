"""The README's commands are what CI runs."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_install_and_test_commands():
    """Catches a .ci/run that installs or tests otherwise than the README tells a newcomer to (a
    pip line with other extras or pins, another pytest invocation), so that CI's green would not
    be the newcomer's: .ci/run's own pip and pytest lines, joined by &&, are a line of the README."""
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    install = [line for line in script if line.startswith("pip install ")]
    test = [line for line in script if line.startswith("python -m pytest")]
    assert len(install) == 1 and len(test) == 1, (install, test)
    # (.ci/run keeps pip's log aside; the command itself is what precedes the redirection)
    words = shlex.split(install[0].split(">", 1)[0])
    command = f"{shlex.join(words[:2])} {' '.join(shlex.quote(w) for w in words[2:])} && {test[0]}"
    readme = (ROOT / "README.md").read_text()
    assert command in readme.splitlines(), f"the README has no line {command!r}"
    assert re.search(r"python -m venv \S+ && \. \S+/bin/activate", readme), "the README makes no virtual environment"
