"""Failures of real processes: a reader killed mid-shard, a dispatcher killed and restarted from
its journal (same and different world size), a restore that cannot be honoured, CurveZMQ."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dispatcher_server.config import CurveConfig, FlowConfig
from dispatcher_server.journal import JournalError
from dispatcher_server.planner import DEFAULT_LLM_CAPACITY_FACTOR, PlannerConfig
from dispatcher_server.security import create_keypair
from dispatcher_server.server import Dispatcher
from mmdispatch import cli
from mmdispatch.serve import parse_ready, read_ready
from tests.test_service import (
    all_keys, client_config, consume, dispatcher, flat_keys, make_config, readers,
    shards,  # noqa: F401 - fixture
)
from trainer_client.client import DispatcherClient


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def start_serve(args: list[str], timeout: float = 30.0) -> tuple[subprocess.Popen, dict]:
    """`mmdispatch serve` on port 0; returns the process and its READY line."""
    proc = spawn(["serve", *args])
    try:
        return proc, read_ready(proc.stdout, timeout)
    except BaseException:
        kill(proc)
        raise


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_reader_killed_mid_shard_loses_and_duplicates_nothing(shards):
    # Tiny credits: the reader stalls inside a shard, holding a partly delivered shard when killed.
    flow = FlowConfig(max_buffered_samples=28, num_inflight_shards=2, max_retained_steps=1,
                      credit_batch=3)
    with dispatcher(make_config(shards, world_size=2, flow=flow)) as srv:
        proc = spawn(["read", "--dispatcher", srv.reader_endpoint, "--timeout", "1.5", "--batch", "3"])
        try:
            registry = srv.metrics.registry
            wait_for(lambda: registry.get_sample_value("mmdispatch_samples_in_total") >= 20)
            partial = [p for p in list(srv.progress.values())
                       if 0 < p.next_index and not p.reader_done]
            assert partial, "the reader should be in the middle of a shard"
        finally:
            kill(proc)
        with readers(srv.reader_endpoint, 2):
            got = consume(srv.trainer_endpoint, 2)
    assert sorted(flat_keys(got)) == sorted(all_keys(shards))


def _serve_args(shards, journal, world_size, microbatches=2):
    return ["--shards", *shards, "--world-size", str(world_size), "--global-batch", "8",
            "--num-microbatches", str(microbatches), "--journal-dir", journal, "--heartbeat", "0.2",
            "--timeout", "1.5", "--max-retained-steps", "3", "--inflight-shards", "3",
            "--max-buffered-samples", "256", "--credit-batch", "8", "--seed", "5",
            "--shuffle-buffer", "64"]


def _served(shards, journal: str, world_size: int, num_readers: int = 2, microbatches: int = 2,
            **consume_kw) -> dict:
    """What `world_size` trainers receive from one `mmdispatch serve` run on `journal` (killed
    after: no clean shutdown, the journal is all that survives) fed by `num_readers` readers."""
    proc, ready = start_serve(_serve_args(shards, journal, world_size, microbatches=microbatches))
    try:
        with readers(ready["readers"], num_readers):
            return consume(ready["trainers"], world_size, **consume_kw)
    finally:
        kill(proc)


def test_dispatcher_restart_replays_exactly_and_replans_for_a_new_world_size(shards, tmp_path):
    journal = str(tmp_path / "journal")
    # serve's planner defaults, as the `mmdispatch serve` runs below have them
    planner = PlannerConfig(num_microbatches=2, llm_capacity_factor=DEFAULT_LLM_CAPACITY_FACTOR)
    reference_cfg = make_config(shards, world_size=2, seed=5, shuffle_buffer=64, planner=planner)
    with dispatcher(reference_cfg) as srv, readers(srv.reader_endpoint, 2):
        reference = consume(srv.trainer_endpoint, 2)
    commit_at = 4

    first = _served(shards, journal, 2, max_steps=commit_at + 1, commit_at=commit_at)
    for r in range(2):
        assert first[r] == reference[r][:commit_at + 1]

    states = {r: {"next_step": commit_at + 1, "rank": r, "world_size": 2} for r in range(2)}
    proc, ready = start_serve(_serve_args(shards, journal, 2))
    try:
        assert ready["next_step"] == commit_at + 1  # resumes after the last committed step
        with readers(ready["readers"], 1):
            second = consume(ready["trainers"], 2, states=states)
    finally:
        kill(proc)
    for r in range(2):
        assert second[r] == reference[r][commit_at + 1:]

    # Three ranks now: same samples per step from the same position, planned for 3 ranks.
    states = {r: {"next_step": commit_at + 1, "rank": r, "world_size": 2} for r in range(3)}
    third = _served(shards, journal, 3, states=states)

    def step_sets(per_rank):
        out: dict[int, set] = {}
        for steps in per_rank.values():
            for s, mbs in steps:
                out.setdefault(s, set()).update(k for keys in mbs for k in keys)
        return out

    expected = {s: keys for s, keys in step_sets(reference).items() if s > commit_at}
    assert step_sets(third) == expected
    assert all(len(third[r]) == len(expected) for r in range(3))


def test_a_dispatcher_restarted_with_more_microbatches_replans_the_journaled_steps(shards,
                                                                                  tmp_path):
    """Killed after a commit with steps journaled past it, restarted with --num-microbatches 4:
    the replayed steps come with 4 micro-batches (they came with the journal's 2), each with
    the samples it had."""
    journal = str(tmp_path / "journal")
    commit_at = 2
    first = _served(shards, journal, 2, commit_at=commit_at)
    states = {r: {"next_step": commit_at + 1, "rank": r, "world_size": 2} for r in range(2)}
    second = _served(shards, journal, 2, microbatches=4, states=states)

    def samples(per_rank, step):
        return sorted(k for steps in per_rank.values() for s, mbs in steps if s == step
                      for keys in mbs for k in keys)

    replayed = sorted({s for s, _ in second[0]})
    assert replayed[0] == commit_at + 1 and len(replayed) == len(first[0]) - commit_at - 1
    assert all(len(mbs) == 4 for steps in second.values() for _, mbs in steps)
    assert all(samples(second, s) == samples(first, s) for s in replayed)


def test_restore_with_another_seed_fails_loudly(shards, tmp_path):
    cfg = make_config(shards, world_size=1, journal_dir=str(tmp_path), max_steps=2)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 1):
        consume(srv.trainer_endpoint, 1, commit_at=1)
    with pytest.raises(JournalError, match="seed: journal has 0, config has 9"):
        Dispatcher(make_config(shards, world_size=1, journal_dir=str(tmp_path), seed=9))
    # Asking for a step the journal cannot place is refused by name, not silently replanned.
    with dispatcher(make_config(shards, world_size=1, journal_dir=str(tmp_path))) as srv:
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        client.load_state_dict({"next_step": 40})
        try:
            with pytest.raises(Exception, match="cannot resume at step 40"):
                next(client)
        finally:
            client.close()


def test_curve_admits_allowed_keys_only(shards, tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    assert cli.main(["keygen", "server", "--dir", str(keys)]) == 0
    server_public, server_secret = str(keys / "server.key"), str(keys / "server.key_secret")
    assert os.stat(server_secret).st_mode & 0o777 == 0o600
    for name in ("reader", "trainer"):
        public, _ = create_keypair(str(keys), name)
        shutil.copy(public, allowed)
    create_keypair(str(keys), "intruder")
    curve = CurveConfig(server_secret_file=server_secret, allowed_keys_dir=str(allowed))
    cfg = make_config(shards, world_size=1, curve=curve, max_steps=2)

    def client(name: str) -> DispatcherClient:
        return DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config(
            secret_file=str(keys / f"{name}.key_secret"), server_public_file=server_public))

    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 1,
                                         secret_file=str(keys / "reader.key_secret"),
                                         server_public_file=server_public):
        intruder = client("intruder")
        intruder.config.step_timeout_s = 2.0
        try:
            with pytest.raises(TimeoutError):
                next(intruder)
        finally:
            intruder.close()
        good = client("trainer")
        try:
            steps = [s.step for s in good]
        finally:
            good.close()
    assert steps == [0, 1]


@pytest.mark.timeout(90)
def test_serve_under_json_logs_writes_only_json_lines(shards, tmp_path):
    """Its ready line on stdout was `READY {...}` under --log-format json too: a collector
    reading a container's stdout and stderr together choked on it."""
    proc = subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", "serve", "--log-format", "json",
                             *_serve_args(shards, str(tmp_path / "j"), 2)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # blocks until bound (the test's timeout bounds it)
        ready = parse_ready(first)
        assert ready["readers"].startswith("tcp://127.0.0.1:") and ready["next_step"] == 0
        early = []  # the planner warms up while serve already serves: its line comes later
        while not early or "planner_ready" not in early[-1]:
            early.append(proc.stderr.readline())
            assert early[-1], early
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        kill(proc)
    lines = [first, *early, *(out + err).splitlines()]
    records = [json.loads(line) for line in lines]  # every line parses
    assert any(r.get("event") == "planner_ready" for r in records), err


#: `mmdispatch serve` whose planner warm-up takes 6 s, as a cold numba cache makes it take 36
_SLOW_WARM_SERVE = (
    "import sys, time\n"
    "import mmdispatch.serve as s\n"
    "warm = s.warm_up\n"
    "s.warm_up = lambda *a, **k: (time.sleep(6), warm(*a, **k))\n"
    "from mmdispatch.cli import main\n"
    "sys.exit(main(['serve', *sys.argv[1:]]))\n"
)


@pytest.mark.timeout(120)
def test_peers_that_join_while_the_planner_compiles_join_once_and_wait(shards, tmp_path):
    """serve bound its sockets, then compiled the planner (36 s on a fresh install) without
    answering: readers and trainers timed out and rejoined, and the log showed rank_replaced
    and reader_left why=reconnected on a normal first start."""
    from tests.servicekit import free_port

    ready = {"readers": f"tcp://127.0.0.1:{free_port()}",
             "trainers": f"tcp://127.0.0.1:{free_port()}"}
    serve = subprocess.Popen([sys.executable, "-c", _SLOW_WARM_SERVE,
                              *_serve_args(shards, str(tmp_path / "j"), 1),
                              "--reader-bind", ready["readers"], "--trainer-bind", ready["trainers"]],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader = None
    try:  # the peers join once it is bound, while the planner compiles
        early = []
        while not early or "event=bound" not in early[-1]:
            early.append(serve.stderr.readline())
            assert early[-1], early
        # READY waits for the planner (a script that starts peers after it, or takes a memory
        # baseline at it, sees a loaded dispatcher); peers connecting before it are answered.
        assert not select.select([serve.stdout], [], [], 1.0)[0], "READY before the planner was ready"
        reader = subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                                   ready["readers"], "--timeout", "2"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        client = DispatcherClient(ready["trainers"], 0, 1, 1, config=client_config())
        try:
            step = next(iter(client))  # planned once the warm-up ends, on the one connection
        finally:
            client.close()
        assert step.step == 0
        reader.send_signal(signal.SIGTERM)
        _, reader_err = reader.communicate(timeout=30)
        serve.send_signal(signal.SIGTERM)
        serve_out, serve_err = serve.communicate(timeout=30)
    finally:
        for proc in (reader, serve):
            if proc is not None:
                kill(proc)
    assert "planner_ready" in serve_err and serve_out.startswith("READY "), (serve_out, serve_err)
    assert "reconnect" not in reader_err, reader_err
    assert "why=reconnected" not in serve_err and "rank_replaced" not in serve_err, serve_err
    assert serve_err.count("reader_joined") == 1, serve_err
