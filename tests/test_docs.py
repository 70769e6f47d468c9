"""The README is the manual: every Make target is in it, in the English and in the Chinese half, and it links the
settings page; every benchmark record in docs/bench is traceable to its run."""

import json
import re

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
