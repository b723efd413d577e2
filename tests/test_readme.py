"""README stays true: its commands exist and every command-line option is documented."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from mmdispatch.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _flags(module_name: str) -> set[str]:
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).add_arguments(parser)
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_setup_commands_come_first_and_exist():
    first_block = README.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
    targets = re.findall(r"^(\w+):", (ROOT / "Makefile").read_text(), re.M)
    assert {"demo", "test"} <= set(targets)


@pytest.mark.parametrize("command", ["serve", "read", "inspect", "gen-data", "demo", "report", "keygen"])
def test_every_option_is_in_the_readme(command):
    missing = sorted(f for f in _flags(COMMANDS[command][0]) if f"`{f}`" not in README)
    assert not missing, f"mmdispatch {command}: options missing from README.md: {missing}"


def test_every_trainer_option_is_in_the_readme():
    from trainer_client.train import build_parser

    flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    missing = sorted(f for f in flags if f"`{f}`" not in README)
    assert not missing, f"trainer_client.train: options missing from README.md: {missing}"
