"""The README is the manual: every Make target is in it, in the English and in the Chinese half, and it links the
settings page; every benchmark record in docs/bench is traceable to its run."""

import json
import os
import re
import sys

from conftest import REPO


def _makefile():
    return (REPO / "Makefile").read_text()


def _readme_halves():
    text = (REPO / "README.md").read_text()
    english, chinese = text.split("\n## 中文\n", 1)
    return english, chinese


def test_every_make_target_is_documented_in_both_languages():
    targets = re.findall(r"^([a-z-]+):.*## ", _makefile(), flags=re.M)
    assert len(targets) >= 15
    for half in _readme_halves():
        missing = [t for t in targets if t not in ("help",) and f"make {t}" not in half]
        assert not missing, missing


def test_the_readme_links_the_settings_page_in_both_languages():
    """Every variable is on docs/settings.md (generated from the registry, tests/test_settings.py)."""
    for half in _readme_halves():
        assert "(docs/settings.md)" in half


def test_every_bench_record_names_its_run_and_is_linked_from_the_benchmarks_page():
    """docs/bench/*.jsonl hold BENCH lines as scripts/bench_run.py prints them, with the date, machine and command
    of the run added (issue 16, "Results"); a record nobody can trace back to a run is worth nothing."""
    page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    records = sorted((REPO / "docs" / "bench").glob("*.jsonl"))
    assert records
    for path in records:
        day = re.search(r"(\d{4}-\d{2}-\d{2})\.jsonl$", path.name)
        assert day, f"{path.name}: named <bench>-<date>.jsonl"
        assert f"(bench/{path.name})" in page, f"{path.name} is not linked from docs/benchmarks.md"
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines, f"{path.name} is empty"
        for number, line in enumerate(lines, 1):
            record = json.loads(line)
            missing = {"label", "date", "machine", "command"} - set(record)
            assert not missing, f"{path.name}:{number} lacks {sorted(missing)}"
            assert record["date"].startswith(day.group(1)), f"{path.name}:{number}: date {record['date']}"


def test_the_readmes_first_block_runs_as_written_up_to_what_needs_a_gpu(tmp_path):
    """The first screen's commands, in order, in a copy of the checkout with RUNTIME=local: .env from .env.example
    with MODEL_PATH, the tiny model, doctor, prep; `make sft` is checked (`make check`: this machine has no GPU),
    `make build` is the container suite's."""
    import shutil
    import subprocess

    block = re.search(r"## On a GPU node, in order\n\n```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert lines[:8] == ["make build", "cp .env.example .env", 'echo "MODEL_PATH=$PWD/models/tiny" >> .env',
                         "make tiny-model", "make prep", "make doctor", "make sft", "make merge"]
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        if (REPO / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k not in ("ENV_FILE", "MODEL_PATH", "DATA_DIR")}
    env.update(RUNTIME="local", PYTHON=sys.executable, PYTHONPATH=str(tmp_path))  # the copy has no .venv
    for line in [*lines[1:6], "make check JOB=sft"]:
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        # no GPU here is doctor's warning, not a red line: every line passes
        assert result.returncode == 0 and "Traceback" not in result.stderr, \
            (line, result.stdout[-2000:], result.stderr)
    assert "preflight sft: passed" in result.stdout and f"{tmp_path}/models/tiny" in result.stdout
