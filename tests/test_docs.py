"""The README is the manual: every Make target and every registered variable (app/settings.py) is in
it, in the English and in the Chinese half."""

import re

from conftest import REPO


def _makefile():
    return (REPO / "Makefile").read_text()


def _readme_halves():
    text = (REPO / "README.md").read_text()
    english, chinese = text.split("## 中文快速开始", 1)
    return english, chinese


def test_every_make_target_is_documented_in_both_languages():
    targets = re.findall(r"^([a-z-]+):.*## ", _makefile(), flags=re.M)
    assert len(targets) >= 15
    for half in _readme_halves():
        missing = [t for t in targets if t not in ("help",) and f"make {t}" not in half]
        assert not missing, missing


def test_every_registered_variable_is_documented_in_both_languages():
    from app.settings import REGISTRY

    for half in _readme_halves():
        missing = [var.name for var in REGISTRY if not re.search(rf"`{var.name}`", half)]
        assert not missing, missing
