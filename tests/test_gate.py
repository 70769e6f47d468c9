"""app.gate, with real processes: the held driver imports what its module imports, runs the module (as `python -m`
does) only once a line comes, stops unrun at end of input, and says a missing module in one line."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO


def write_modules(where: Path) -> None:
    """`heavy` stands for verl (it records that it was imported); `pkg.driver` for verl.trainer.main_ppo: it imports
    heavy at its top, records each time its body runs and, run as __main__, its argv."""
    (where / "heavy.py").write_text("from pathlib import Path\nPath(__file__).with_name('imported').touch()\n")
    (where / "pkg").mkdir()
    (where / "pkg" / "__init__.py").write_text("")
    (where / "pkg" / "driver.py").write_text(
        "import json, sys\nimport heavy\nfrom pathlib import Path\n\n"
        "with Path(heavy.__file__).with_name('executions').open('a') as f:\n    f.write(__name__ + ' ')\n"
        "if __name__ == '__main__':\n"
        "    Path(heavy.__file__).with_name('ran').write_text(json.dumps(sys.argv[1:]))\n")


def gate(where: Path, module: str, stdin=subprocess.PIPE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{where}{os.pathsep}{REPO}"}
    return subprocess.Popen([sys.executable, "-m", "app.gate", module, "a=1", "b=2"], env=env, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists()


def test_the_held_driver_imports_first_and_runs_its_module_with_its_arguments_only_after_the_go(tmp_path):
    write_modules(tmp_path)
    process = gate(tmp_path, "pkg.driver")
    wait_for(tmp_path / "imported")
    time.sleep(0.5)
    assert process.poll() is None and not (tmp_path / "ran").exists()  # imported, held
    out, err = process.communicate("go\n", timeout=60)
    assert process.returncode == 0, err
    assert (tmp_path / "ran").read_text() == '["a=1", "b=2"]'
    # its body ran once, as __main__ (importing it first would run it twice, and runpy warns of that)
    assert (tmp_path / "executions").read_text() == "__main__ " and "Warning" not in err


def test_a_go_that_is_a_json_list_adds_its_arguments_to_the_modules(tmp_path):
    """grpo-head's last arguments come with the go: the count of the prompts chose them while the driver imported."""
    write_modules(tmp_path)
    process = gate(tmp_path, "pkg.driver")
    out, err = process.communicate('["c=3", "x y"]\n', timeout=60)
    assert process.returncode == 0, err
    assert json.loads((tmp_path / "ran").read_text()) == ["a=1", "b=2", "c=3", "x y"]


def test_preload_imports_a_module_the_driver_imports_only_when_it_runs(tmp_path):
    write_modules(tmp_path)
    (tmp_path / "late.py").write_text("from pathlib import Path\nPath(__file__).with_name('late-imported').touch()\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    process = subprocess.Popen([sys.executable, "-m", "app.gate", "--preload", "json,late", "pkg.driver", "a=1"],
                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "late-imported")
    assert process.poll() is None and not (tmp_path / "ran").exists()  # imported, held
    out, err = process.communicate("go\n", timeout=60)
    assert process.returncode == 0 and (tmp_path / "ran").read_text() == '["a=1"]', err


def test_end_of_input_stops_the_held_driver_unrun_and_quietly(tmp_path):
    write_modules(tmp_path)
    process = gate(tmp_path, "pkg.driver")
    out, err = process.communicate("", timeout=60)
    assert (process.returncode, out, err) == (0, "", "")
    assert (tmp_path / "imported").exists() and not (tmp_path / "executions").exists()


def test_a_missing_module_is_one_line_as_python_m_says_it(tmp_path):
    process = gate(tmp_path, "no_such_driver")
    out, err = process.communicate("go\n", timeout=60)
    assert process.returncode == 1 and err == f"{sys.executable}: No module named no_such_driver\n"


def test_on_a_terminal_the_driver_runs_at_once(tmp_path):
    write_modules(tmp_path)
    leader, follower = pty.openpty()
    try:
        process = gate(tmp_path, "pkg.driver", stdin=follower)
        out, err = process.communicate(timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    assert process.returncode == 0, err
    assert (tmp_path / "ran").read_text() == '["a=1", "b=2"]'
