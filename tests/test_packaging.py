"""The core install is what a data node needs: every core dependency is imported by the package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mmdispatch", "pipeline", "dispatcher_server", "trainer_client")
IMPORT_NAMES = {"pyzmq": "zmq", "pillow": "PIL", "prometheus-client": "prometheus_client"}


def _imported_modules() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found |= set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", path.read_text(), re.M))
    return found


def test_every_core_dependency_is_used_by_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    imported = _imported_modules()
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower()
        module = IMPORT_NAMES.get(name, name.replace("-", "_"))
        assert module in imported, f"{requirement} is a core dependency nothing in {PACKAGES} imports"


def test_torch_is_only_in_the_trainer_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(r.startswith("torch") for r in project["dependencies"])
    assert any(r.startswith("torch") for r in project["optional-dependencies"]["trainer"])
