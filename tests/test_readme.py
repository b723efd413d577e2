"""The README and docs/ stay true: commands and options they show exist, generated references
are current, and no dated history creeps back in."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from mmdispatch import docgen
from mmdispatch.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def _code_lines(text: str) -> list[str]:
    """Lines of the shell code blocks (fences without a language, or `bash`), comments cut."""
    lines, inside, shell = [], False, False
    for line in text.splitlines():
        if line.startswith("```"):
            inside, shell = not inside, line.strip() in ("```", "```bash")
        elif inside and shell:
            lines.append(line)
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines()]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _train_parser() -> argparse.ArgumentParser:
    from trainer_client.options import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_setup_commands_come_first_and_exist():
    first_block = README.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
    targets = set(re.findall(r"^(\w+):", (ROOT / "Makefile").read_text(), re.M))
    for line in _code_lines(README):
        if line.startswith("make "):
            assert line.split()[1] in targets, line
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_SPEC \?= torch==", makefile, re.M) and re.search(r"^TORCH_INDEX \?=", makefile, re.M)


def test_readme_is_a_front_door():
    assert len(README.encode()) <= 12_500, f"README.md is {len(README.encode())} bytes"
    for line in ("pip install mmdispatch", "pip install 'mmdispatch[trainer]'"):
        assert line in README
    assert "Your own shards in three commands" in README
    for doc in ("deployment", "configuration", "benchmarks", "reliability", "design"):
        assert f"(docs/{doc}.md)" in README and (DOCS / f"{doc}.md").exists(), doc


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_commands_shown_exist_with_their_options(doc):
    text = (ROOT / doc if doc == "README.md" else DOCS / doc).read_text()
    checked = 0
    for line in _code_lines(text):
        words = shlex.split(line.removeprefix("$ ").replace("...", ""), posix=True) if line else []
        if len(words) >= 2 and words[0] == "mmdispatch" and not words[1].startswith("-") \
                and not words[1].endswith(":"):
            assert words[1] in COMMANDS, line
            parser, used = build_parser(words[1]), words[2:]
        elif "trainer_client.train" in words:
            parser, used = _train_parser(), words[words.index("trainer_client.train") + 1:]
        else:
            continue
        unknown = [w for w in used if w.startswith("--") and w not in _flags(parser)]
        assert not unknown, f"{doc}: {line!r} uses options the command lacks: {unknown}"
        checked += 1
    if doc == "README.md":
        assert checked >= 6


@pytest.mark.timeout(60)
def test_the_error_example_is_what_the_command_prints(tmp_path):
    import subprocess
    import sys

    block = re.search(r"```\n\$ (mmdispatch [^\n]*)\n([^\n]*)\n```", README)
    assert block, "README shows no error example"
    argv = shlex.split(block[1])
    out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", *argv[1:]], cwd=tmp_path, capture_output=True,
                         text=True, timeout=30, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1] == block[2]


@pytest.mark.parametrize("name", sorted(docgen.GENERATED))
def test_generated_docs_are_current(name):
    expected = docgen.GENERATED[name]()
    assert (DOCS / name).read_text() == expected, f"docs/{name} is stale: run `python -m mmdispatch.docgen`"


@pytest.mark.parametrize("command", [*COMMANDS, "train"])
def test_every_option_is_in_the_configuration_reference(command):
    reference = (DOCS / "configuration.md").read_text()
    parser = _train_parser() if command == "train" else build_parser(command)
    missing = sorted(f for f in _flags(parser) if f.startswith("--") and f != "--help" and f"`{f}`" not in reference)
    assert not missing, f"{command}: options missing from docs/configuration.md: {missing}"


def test_benchmark_tables_come_from_recorded_json():
    recorded = {p.stem for p in (DOCS / "bench").glob("*.json")}
    assert {"counting", "planner"} <= recorded
    text = (DOCS / "benchmarks.md").read_text()
    for name in recorded:
        assert f"`bench.{name}`" in text and f"No recorded run. Record one with `python -m bench.{name} " not in text


HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\(was [\d.]|\bwas \d[\d.]* ?(ms|s|MB|x)\b|\bBefore the journal\b")


def test_no_dated_history_in_docs_or_code():
    paths = [ROOT / "README.md", *DOCS.glob("*.md")]
    for package in ("mmdispatch", "pipeline", "dispatcher_server", "trainer_client", "bench"):
        paths += list((ROOT / package).rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in paths for m in HISTORY.finditer(p.read_text())]
    assert not found, f"history belongs in git, not in prose: {found}"


def test_on_off_options_show_valid_toml_and_their_default():
    """`--refit`/`--no-refit` and the like: the file key is a TOML boolean and the default is
    shown (argparse's `const` is None for them, which once read `refit = none`)."""
    reference = (DOCS / "configuration.md").read_text()
    assert "= none`" not in reference
    rows = {line.split("|")[1].strip(): line.split("|") for line in reference.splitlines()
            if line.startswith("| `--")}
    assert rows["`--refit`, `--no-refit`"][2:4] == [" `[serve] refit = true` ", " `false` "]
    assert rows["`--map-shards`, `--no-map-shards`"][2:4] == [" `[counting] map_shards = false` ", " `true` "]
    assert "(default: false)" in " ".join(build_parser("serve").format_help().split())
    assert "(default: true)" in " ".join(build_parser("read").format_help().split())
