"""`mmdispatch demo` end to end on a tiny dataset: per-step lines, report, figure, clean exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_demo_trains_reports_and_stops_everything(tmp_path):
    steps = 3
    out = subprocess.run(
        [sys.executable, "-m", "mmdispatch.cli", "demo", "--data", str(tmp_path / "data"), "--samples", "96",
         "--shards", "3", "--steps", str(steps), "--global-batch", "16", "--reports", str(tmp_path / "reports"),
         "--timeout", "240"],
        capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    step_lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == steps and all("loss" in line and "max/mean" in line for line in step_lines)
    assert "modality mix" in out.stdout  # the data node's inspect report of the generated data
    (run_dir,) = (tmp_path / "reports").iterdir()
    summary = json.loads((run_dir / "report.json").read_text())
    assert summary["num_steps"] == steps and summary["predicted_speedup_vs_random"] >= 1.0
    # A dataset file of three weighted sources: the realized mixture is printed and reported.
    assert set(summary["sources"]) == {"captions", "speech", "chat"}
    assert sum(s["samples"] for s in summary["sources"].values()) == steps * 16
    assert "realized mixture: captions" in out.stdout and "(weight 50.0%)" in out.stdout
    assert (run_dir / "demo.png").stat().st_size > 20_000
    # Every child was stopped: no process still runs from this run's folder.
    ps = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps


def test_the_mixture_line_of_one_source_says_it_has_every_sample():
    from types import SimpleNamespace

    from mmdispatch.demo import _mixture_line

    one = [SimpleNamespace(name="only", weight=1.0)]
    assert _mixture_line({}, one) == "one source: only, every sample"
    two = [SimpleNamespace(name="a", weight=1.0), SimpleNamespace(name="b", weight=3.0)]
    line = _mixture_line({"sources": {"a": {"share": 0.25}, "b": {"share": 0.75}}}, two)
    assert line == "realized mixture: a 25.0% (weight 25.0%), b 75.0% (weight 75.0%)"


def _running_from(folder) -> dict[int, str]:
    """pid -> command line of every process whose arguments name `folder`."""
    ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    return {int(pid): args for pid, _, args in (line.strip().partition(" ") for line in ps.splitlines())
            if str(folder) in args}


@pytest.mark.timeout(120)
def test_sigterm_stops_every_process_the_demo_started(tmp_path):
    import os
    import signal
    import time

    out, err = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    demo = subprocess.Popen(
        [sys.executable, "-m", "mmdispatch.cli", "demo", "--data", str(tmp_path / "data"), "--samples", "24",
         "--shards", "3", "--steps", "1000", "--global-batch", "8", "--reports", str(tmp_path / "reports"),
         "--timeout", "100"], stdout=out, stderr=err)
    try:
        # Dispatcher, 2 readers, 2 torchrun agents and their 4 trainers: the trainers are the
        # agents' children, the deepest processes the demo owns.
        deadline = time.monotonic() + 80
        while sum("trainer_client.train" in a for a in _running_from(tmp_path).values()) < 6:
            assert demo.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, _running_from(tmp_path)
            time.sleep(0.2)
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=30)
    finally:
        if demo.poll() is None:
            demo.kill()
        out.close()
        err.close()
        deadline = time.monotonic() + 5
        while (left := _running_from(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:  # a failing test leaves nothing running either
            os.kill(pid, signal.SIGKILL)
    assert not left, left
    assert code == 128 + signal.SIGTERM
    assert "stopping every process the demo started" in (tmp_path / "err.txt").read_text()


@pytest.mark.parametrize("option, value, words", [
    ("readers", 0, ["--readers", ">= 1", "got 0"]),
    ("nodes", 0, ["--nodes", ">= 1", "got 0"]),
    ("steps", 0, ["--steps", ">= 1", "got 0"]),
    ("microbatches", 0, ["--microbatches", ">= 1", "got 0"]),
    ("ranks_per_node", 0, ["--ranks-per-node", ">= 1", "got 0"]),
    ("global_batch", -1, ["--global-batch", ">= 1", "got -1"]),
    ("samples", 0, ["--samples", ">= 1", "got 0"]),
    ("shards", 0, ["--shards", ">= 1", "got 0"]),
    ("shards", 1000, ["--shards 1000", "--samples 512"]),
    ("microbatches", 33, ["--microbatches 33", "--global-batch 32"]),
    ("seed", -1, ["--seed", "2**63 - 1", "got -1"]),
    ("timeout", 0.0, ["--timeout", "> 0", "got 0.0"]),
])
def test_demo_refuses_an_option_out_of_range_before_generating_data(tmp_path, monkeypatch, option, value,
                                                                   words):
    import argparse

    from mmdispatch import demo
    from pipeline import gendata

    def generate_blend(*args, **kwargs):
        raise AssertionError("the demo generated data before checking its options")

    monkeypatch.setattr(gendata, "generate_blend", generate_blend)

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--data", str(tmp_path / "data"), "--reports", str(tmp_path / "reports")])
    demo.check_options(args)  # the defaults are fine
    setattr(args, option, value)
    with pytest.raises(ValueError) as refused:
        demo.run(args)
    assert all(word in str(refused.value) for word in words), str(refused.value)
    assert not (tmp_path / "data").exists() and not (tmp_path / "reports").exists()


class _Reached(Exception):
    """Raised where a test has seen what it came for, before the demo starts processes."""


def _run_until_inspect(tmp_path, monkeypatch, data) -> dict:
    """demo.run on `data` up to the data node's inspect report: the shards it was given and
    the tokenizer the readers would get. Generating a blend fails the test."""
    import argparse

    from mmdispatch import demo
    from pipeline import gendata

    def generate_blend(*args, **kwargs):
        raise AssertionError("the demo generated a blend into a directory of shards")

    seen = {}

    def inspect(shards, reader_args):
        seen.update(shards=sorted(map(str, shards)), tokenizer=reader_args[-1])
        raise _Reached

    monkeypatch.setattr(gendata, "generate_blend", generate_blend)
    monkeypatch.setattr(demo, "_inspect", inspect)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--data", str(data), "--reports", str(tmp_path / "reports")])
    with pytest.raises(_Reached):
        demo.run(args)
    seen["flags"] = demo.choose_data(args)[1]
    return seen


def test_demo_trains_on_the_shards_in_data_and_writes_nothing_beside_them(tmp_path, monkeypatch,
                                                                          small_shards):
    """--data DIR holding shards and no dataset.toml (gen-data's, or the user's own): the demo
    generated a blend into DIR, beside or over them; it trains on them as one source."""
    import shutil

    from mmdispatch.cli import main

    generated, theirs = tmp_path / "generated", tmp_path / "theirs"
    assert main(["gen-data", str(generated), "--samples", "8", "--shards", "2"]) == 0
    theirs.mkdir()
    for i, shard in enumerate(small_shards[:2]):
        shutil.copy(shard, theirs / f"part-{i}.tar")
    for data in (generated, theirs):
        before = {p.name: p.read_bytes() for p in data.iterdir()}
        seen = _run_until_inspect(tmp_path, monkeypatch, data)
        assert seen["shards"] == sorted(str(p) for p in data.glob("*.tar"))
        assert seen["flags"] == ["--shards", str(data)]
        assert {p.name: p.read_bytes() for p in data.iterdir()} == before
    # gen-data's tokenizer is used; the user's directory gets none: it is trained into the run's folder
    assert seen["tokenizer"].startswith(str(tmp_path / "reports"))
    assert _run_until_inspect(tmp_path, monkeypatch, generated)["tokenizer"] == str(generated / "tokenizer.json")


def test_demo_refuses_data_holding_other_files_and_leaves_them_alone(tmp_path, monkeypatch, small_shards):
    """No dataset.toml, no shards, but files: not a directory to generate a blend into."""
    import argparse
    import shutil

    from mmdispatch import demo
    from pipeline import gendata

    def generate_blend(*args, **kwargs):
        raise AssertionError("the demo generated a blend beside the user's files")

    monkeypatch.setattr(gendata, "generate_blend", generate_blend)
    data = tmp_path / "data"
    (data / "nested").mkdir(parents=True)
    shutil.copy(small_shards[0], data / "nested" / "mine.tar")
    (data / "notes.txt").write_text("mine")
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--data", str(data), "--reports", str(tmp_path / "reports")])
    with pytest.raises(ValueError) as refused:
        demo.run(args)
    words = ["--data", "no dataset.toml", "nested/", "notes.txt", "dataset.toml (docs/datasets.md)",
             "new or empty directory"]
    assert all(word in str(refused.value) for word in words), str(refused.value)
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == ["nested", "nested/mine.tar", "notes.txt"]
    assert not (tmp_path / "reports").exists()


def test_the_ports_the_demo_picks_lie_below_the_ephemeral_range_and_are_free():
    """A port from bind(0) is in the range outgoing connections take theirs from: between the
    pick and torch's TCPStore binding it, one of the run's ZeroMQ connections took it
    (EADDRINUSE, a failed bench.feed run). Picked below that range, it stays free."""
    import socket

    from mmdispatch.demo import _LOW_PORT, _ephemeral_low, _free_port

    low = _ephemeral_low()
    for _ in range(20):
        port = _free_port()
        assert _LOW_PORT <= port < low, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free
