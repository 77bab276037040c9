"""Every distribution of the repository says its licence and ships its text."""

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [ROOT, *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))]


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda p: p.name)
def test_a_distribution_declares_the_licence_and_carries_its_text(dist):
    project = tomllib.loads((dist / "pyproject.toml").read_text())["project"]
    assert project.get("license") == {"text": "Apache-2.0"}, project["name"]
    text = (dist / "LICENSE").read_text()  # (a plugin's is a link to the repository's)
    assert text == (ROOT / "LICENSE").read_text() and "Apache License" in text


def test_the_changelog_names_the_current_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()
