"""One configuration file for every command: its schema follows the options, flags win over it."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from dispatcher_server.cliopts import JsonFormatter
from mmdispatch import settings
from mmdispatch.cli import build_parser

FILE = """
[serve]
world_size = 8
global_batch = 64
shards = "data/shard-{000000..000003}.tar"

[read]
dispatcher = "tcp://dispatcher:5555"
workers = 3

[train]
dispatcher = "tcp://dispatcher:5556"
steps = 7

[counting]
patch_size = 16
merge_size = 4
json_field = "caption"
"""


def _parse(command: str, path, *flags: str) -> argparse.Namespace:
    if command == "train":
        from trainer_client.options import add_arguments

        parser = argparse.ArgumentParser()
        add_arguments(parser)
    else:
        parser = build_parser(command)
    argv = ["--config", str(path), *flags]
    settings.apply_file(parser, command, argv)
    return parser.parse_args(argv)


def test_each_command_takes_its_table_and_the_shared_counting_rules(tmp_path):
    path = tmp_path / "mmd.toml"
    path.write_text(FILE)
    read = _parse("read", path)
    assert (read.dispatcher, read.workers, read.patch_size, read.merge_size) == ("tcp://dispatcher:5555", 3, 16, 4)
    assert read.json_field == ["caption"]  # a lone value for a repeatable option is a one-item list
    train = _parse("train", path)
    assert (train.dispatcher, train.steps, train.patch_size, train.merge_size) == ("tcp://dispatcher:5556", 7, 16, 4)
    inspect = _parse("inspect", path, "shard.tar")
    assert inspect.patch_size == 16 and inspect.shards == ["shard.tar"]


def test_flags_win_over_the_file(tmp_path):
    path = tmp_path / "mmd.toml"
    path.write_text(FILE)
    read = _parse("read", path, "--workers", "1", "--patch-size", "14", "--dispatcher", "tcp://other:1")
    assert (read.workers, read.patch_size, read.dispatcher) == (1, 14, "tcp://other:1")
    train = _parse("train", path, "--merge", "2")
    assert train.merge_size == 2
    # a repeatable flag replaces the file's list (it was appended to it)
    read = _parse("read", path, "--json-field", "text", "--json-field", "msg")
    assert read.json_field == ["text", "msg"]
    assert _parse("inspect", path, "--json-field", "text", "shard.tar").json_field == ["text"]


def test_serve_resolves_file_then_flags(tmp_path):
    from mmdispatch import serve

    path = tmp_path / "mmd.toml"
    path.write_text(FILE)
    values = serve.resolve(_parse("serve", path, "--world-size", "4"))
    assert values["world_size"] == 4 and values["global_batch"] == 64
    assert values["shards"] == ["data/shard-{000000..000003}.tar"]


def test_a_flag_turns_off_what_the_file_turns_on(tmp_path):
    """True/false settings had no flag to undo them: a shared file's exit_when_done = true or
    map_shards = false could not be overridden on one command line."""
    from mmdispatch import serve

    path = tmp_path / "mmd.toml"
    path.write_text(FILE.replace("[serve]", "[serve]\nexit_when_done = true\nrefit = true", 1))
    assert serve.resolve(_parse("serve", path))["exit_when_done"] is True
    values = serve.resolve(_parse("serve", path, "--no-exit-when-done", "--no-refit"))
    assert values["exit_when_done"] is False and values["refit"] is False
    counting = tmp_path / "counting.toml"
    counting.write_text('[counting]\nmap_shards = false\n[read]\ndispatcher = "tcp://d:5555"\n')
    assert _parse("read", counting).map_shards is False
    assert _parse("read", counting, "--map-shards").map_shards is True


def test_every_option_of_every_table_is_a_typed_setting():
    model = settings.schema()
    for table in settings.TABLES:
        fields = model.model_fields[table].annotation.__args__[0].model_fields
        assert set(fields) == set(settings.settings_of(table)), table
    # a setting is defined once: no key appears in two tables
    keys = [k for t in settings.TABLES for k in settings.settings_of(t)]
    shared = {k for k in keys if keys.count(k) > 1} - {"log_level", "log_format", "dispatcher", "timeout",
                                                       "curve_secret", "curve_server_key", "seed",
                                                       "malloc_keep_mb", "map_shards", "connect_timeout"}
    assert not shared, f"defined in two tables: {sorted(shared)}"
    assert not set(settings.settings_of("train")) & set(settings.settings_of("counting"))


@pytest.mark.parametrize("text, words", [
    ("[serve]\nworld_size = true\n", ["[serve] world_size", "integer", "True"]),
    ("[serve]\nmode = \"fast\"\n", ["[serve] mode", "'deterministic' or 'arrival'", "'fast'"]),
    ("[read]\nworkers = 2\nwokers = 3\n", ["[read] wokers", "did you mean workers?"]),
    ("[counting]\nmax_pixels = 1.5\n", ["[counting] max_pixels", "integer", "1.5"]),
    ("[serving]\nseed = 1\n", ["'serving'", "[serve]"]),
    ("[train]\nlr = \"fast\"\n", ["[train] lr", "number", "'fast'"]),
])
def test_wrong_types_and_unknown_keys_are_named(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(settings.ConfigError) as err:
        settings.load(str(path))
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message, message


def test_json_log_lines_carry_the_event_fields():
    record = logging.LogRecord("mmdispatch.reader", logging.WARNING, __file__, 1,
                               "mmdispatch event=reader_reconnect dispatcher=%s backoff_s=%.2f",
                               ("tcp://x:1", 0.4), None)
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "WARNING" and line["event"] == "reader_reconnect"
    assert line["dispatcher"] == "tcp://x:1" and line["backoff_s"] == 0.4  # a number


@pytest.mark.timeout(60)
def test_log_format_json_makes_every_log_line_a_json_object(tmp_path):
    import io
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    shard = tmp_path / "bad.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(3):
            data = b"not an image"
            info = tarfile.TarInfo(f"s{i}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    root = Path(__file__).resolve().parents[1]
    (unknown := tmp_path / "unknown.toml").write_text("[serve]\nbogus_key = 1\n")
    (empty := tmp_path / "empty.tar").write_bytes(b"")
    out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "inspect", "--log-format", "json", "--json",
                          str(shard)], capture_output=True, text=True, timeout=30,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    logged = [line for line in out.stderr.splitlines() if line.startswith("{")]
    assert logged, out.stderr
    records = [json.loads(line) for line in logged]
    *warnings, closing = records  # every sample is bad: the closing line says no sample read
    assert warnings and all(r["level"] == "WARNING" and "bad.tar" in r["message"] for r in warnings)
    assert closing["level"] == "ERROR" and "no readable sample" in closing["message"], closing
    assert json.loads(out.stdout)["bad_shards"][0]["by_reason"] == {"bad_image": 3}
    # the line that ends a command, a mistake's included, is JSON too (it was plain text)
    for argv in (["serve", "--log-format", "json", "--shards", str(tmp_path / "none.tar"),
                  "--world-size", "1", "--global-batch", "8"],
                 ["read", "--log-format", "json", "--dispatcher", "tcp://127.0.0.1:1",
                  "--connect-timeout", "1", "--workers", "2"],
                 # a mistake argparse finds, before logging is set up (it was plain text)
                 ["serve", "--log-format", "json", "--mode", "bogus"],
                 ["gen-data", "--log-format=json", "--samples", "x", str(tmp_path / "g")],
                 # a settings file's mistake, found before argparse reads the line (plain text)
                 ["serve", "--log-format", "json", "--config", str(unknown), "--world-size", "1"],
                 # inspect's closing error when no shard has a readable sample (plain text)
                 ["inspect", "--log-format", "json", str(empty)]):
        out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", *argv], capture_output=True,
                             text=True, timeout=60, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
        lines = out.stderr.splitlines()
        assert out.returncode != 0 and lines, out.stderr
        records = [json.loads(line) for line in lines]  # every line parses
        # read's workers race to fail first: whichever it was, its line and the supervisor's say so
        assert any(r["level"] == "ERROR" and ("error:" in r["message"] or "read: worker " in r["message"])
                   for r in records)


@pytest.mark.timeout(120)
def test_a_data_node_validates_every_table_and_writes_the_reference_without_torch():
    import subprocess
    import sys

    probe = ("import sys\n"
             "from mmdispatch import docgen, settings\n"
             "settings.schema(); docgen.configuration_md()\n"
             "leaked = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
             "sys.exit('torch leaked: ' + ','.join(leaked[:5]) if leaked else 0)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_flag_of_an_exclusive_pair_replaces_the_files_other_half(tmp_path):
    """A shared file's num_microbatches = 2 and a typed --microbatch-token-budget: the flag wins
    (it was refused as 'set exactly one of --num-microbatches and --microbatch-token-budget',
    blaming a flag never typed); both typed, or both in the file, is refused naming where."""
    from mmdispatch import serve

    path = tmp_path / "mmd.toml"
    path.write_text(FILE.replace("[serve]", "[serve]\nnum_microbatches = 2", 1))
    values = serve.resolve(_parse("serve", path, "--microbatch-token-budget", "4000"))
    assert (values["num_microbatches"], values["microbatch_token_budget"]) == (None, 4000)
    values = serve.resolve(_parse("serve", path, "--microbatch-token", "4000"))  # a prefix, as argparse takes it
    assert values["num_microbatches"] is None
    values = serve.resolve(_parse("serve", path, "--dataset", "d.toml"))  # the file's shards give way
    assert (values["shards"], values["dataset"]) == (None, "d.toml")
    assert serve.resolve(_parse("serve", path))["num_microbatches"] == 2
    with pytest.raises(ValueError, match=r"--num-microbatches 3 and --microbatch-token-budget 4000 "
                                         r"are both on the command line"):
        serve.resolve(_parse("serve", path, "--num-microbatches", "3", "--microbatch-token-budget", "4000"))
    path.write_text(FILE.replace("[serve]", "[serve]\nnum_microbatches = 2\nmicrobatch_token_budget = 9", 1))
    with pytest.raises(ValueError, match=r"mmd.toml: \[serve\] sets both num_microbatches = 2 and "
                                         r"microbatch_token_budget = 9"):
        serve.resolve(_parse("serve", path))


@pytest.mark.timeout(120)
def test_a_range_mistake_from_the_settings_file_names_the_file_and_key(tmp_path):
    """It named only the flag (`--global-batch must be >= 1`), which the user never typed."""
    import subprocess
    import sys

    path = tmp_path / "job.toml"
    path.write_text("[serve]\nglobal_batch = -3\nworld_size = 2\nshards = ['x.tar']\n"
                    "[read]\nbatch = 0\n")
    runs = {"serve": ["serve", "--config", str(path)],
            "read": ["read", "--config", str(path), "--dispatcher", "tcp://127.0.0.1:9"],
            "typed": ["read", "--config", str(path), "--dispatcher", "tcp://127.0.0.1:9",
                      "--batch", "0"]}
    err = {name: subprocess.run([sys.executable, "-m", "mmdispatch.cli", *argv],
                                capture_output=True, text=True, timeout=100).stderr.strip()
           for name, argv in runs.items()}
    assert err["serve"].endswith(f"(set by global_batch = -3 in [serve] of {path})"), err
    assert err["read"].endswith(f"(set by batch = 0 in [read] of {path})"), err
    assert "--batch must be >= 1" in err["typed"] and str(path) not in err["typed"], err
    assert all(len(e.splitlines()) == 1 for e in err.values()), err
