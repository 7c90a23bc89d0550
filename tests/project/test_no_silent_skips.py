"""A test may skip when an optional third-party package is absent, never when one of the project's own modules
fails to import: after a move (tests/ into folders) such a skip hid a test that no longer ran at all."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
IMPORTORSKIP = re.compile(r"importorskip\(\s*[\"']([\w.]+)[\"']")
OWN = ("featcal", "tests", "test_", "conftest", "decoderbench")


def own_module_skips(text: str) -> list[str]:
    return [name for name in IMPORTORSKIP.findall(text) if name.split(".")[0].startswith(OWN)]


def test_the_pattern_finds_an_own_module_skip():
    assert own_module_skips('x = pytest.importorskip("test_pipeline_support")') == ["test_pipeline_support"]
    assert own_module_skips("pytest.importorskip('featcal.calibration.front.pipeline')") == ["featcal.calibration.front.pipeline"]
    assert own_module_skips('pytest.importorskip("gguf")') == []


def test_no_test_skips_when_the_projects_own_module_is_missing():
    found = {str(p.relative_to(TESTS)): hits for p in sorted(TESTS.rglob("*.py"))
             if p.name != Path(__file__).name and (hits := own_module_skips(p.read_text()))}
    assert found == {}, f"import the project's own modules directly (a missing one must fail): {found}"
