"""The peer session readers and trainer clients share, against a scripted ROUTER (no dispatcher):
HELLO/WELCOME by seq, heartbeats, reconnects, BYE on every clean exit, END, the connect timeout;
and what the trainer client does with it: the dataset in its state, commit failures.
Every receive has a timeout; processes are killed whatever happens.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from dispatcher_server import protocol as P
from dispatcher_server.session import PeerSession, SessionConfig, Unreachable
from pipeline.service import ReaderServiceConfig, ReaderWorker
from tests.servicekit import ScriptedRouter, free_port, wait_for
from trainer_client.client import ClientConfig, DispatcherClient, DispatcherError

UNRESOLVABLE = "tcp://mmdispatch-no-such-host.invalid:5555"


class _Role:
    """A PeerRole that records what the session tells it."""

    def __init__(self) -> None:
        self.welcomes: list[P.Message] = []
        self.messages: list[P.Message] = []
        self.resets = 0

    def hello_fields(self) -> dict:
        return {"role": "reader", "name": "probe"}

    def reset(self) -> None:
        self.resets += 1

    def on_welcome(self, session, msg) -> None:
        self.welcomes.append(msg)

    def on_message(self, session, msg) -> bool:
        self.messages.append(msg)
        if msg.type == P.END:
            session.finish()
        return True

    def tick(self, session) -> bool:
        return False


@contextmanager
def _running(target, *args):
    """`target(*args)` in a thread; yields the list of what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield errors, thread
    finally:
        thread.join(10)
    assert not thread.is_alive(), "the peer did not stop"


def _session(address: str, **kw) -> tuple[PeerSession, _Role]:
    role = _Role()
    cfg = dict(address=address, timeout_s=1.0, poll_ms=10, backoff_min_s=0.05, backoff_max_s=0.1)
    return PeerSession(SessionConfig(**{**cfg, **kw}), role, name="probe"), role


# -- the session ---------------------------------------------------------------------------------
def test_welcome_counts_only_with_the_hellos_seq_then_heartbeats_and_bye():
    with ScriptedRouter() as router:
        session, role = _session(router.endpoint)
        stop = threading.Event()
        with _running(session.run, stop) as (errors, _):
            hello = router.expect(P.HELLO)
            assert (hello["role"], hello["name"]) == ("reader", "probe")
            router.send(P.WELCOME, role="reader", ack=hello.seq + 7, heartbeat_s=0.1)
            time.sleep(0.2)
            assert not session.welcomed and role.welcomes == []
            router.welcome(hello, heartbeat_s=0.1)
            beat = router.recv(2.0, heartbeats=True)
            assert beat is not None and beat.type == P.HEARTBEAT  # at the WELCOME's interval
            assert session.welcomed and len(role.welcomes) == 1
            router.send(P.CREDIT, assign_id=3, samples=4)
            time.sleep(0.1)
            stop.set()
            router.expect(P.BYE, 2.0)
    assert not errors
    assert [m.type for m in role.messages] == [P.CREDIT]


def test_a_silent_dispatcher_means_reconnect_and_hello_again(caplog):
    caplog.set_level(logging.WARNING)
    with ScriptedRouter() as router:
        session, role = _session(router.endpoint, timeout_s=0.5)
        stop = threading.Event()
        with _running(session.run, stop) as (errors, _):
            router.welcome(router.expect(P.HELLO))
            first = router.ident
            again = router.expect(P.HELLO, 5.0)  # nothing heard for 0.5 s: a new connection
            assert router.ident != first and session.num_reconnects >= 1
            router.welcome(again)
            time.sleep(0.1)
            assert session.welcomed
            stop.set()
    assert not errors and role.resets >= 1
    # The reconnect line says why: it heard nothing for the silence it allows.
    (line, *_) = [r.getMessage() for r in caplog.records if "_reconnect " in r.getMessage()]
    assert re.search(r"why='nothing from the dispatcher for [\d.]+ s \(stopped", line), line


def test_unknown_peer_gets_a_hello_on_the_same_connection():
    with ScriptedRouter() as router:
        session, role = _session(router.endpoint)
        stop = threading.Event()
        with _running(session.run, stop):
            router.welcome(router.expect(P.HELLO))
            first = router.ident
            router.send(P.ERROR, code="unknown_peer", message="who are you?")
            router.expect(P.HELLO)
            assert router.ident == first and not session.welcomed
            stop.set()


def test_refusals_of_messages_sent_before_the_hello_draw_no_second_hello():
    """A restarted dispatcher refuses every message a peer sent before it said HELLO again (each
    ERROR unknown_peer acks the refused seq): a HELLO for each made the dispatcher take the peer
    up to 8 times (trainer_joined 8 times, each replacing the last). One HELLO answers them."""
    with ScriptedRouter() as router:
        session, role = _session(router.endpoint)
        stop = threading.Event()
        with _running(session.run, stop):
            router.welcome(router.expect(P.HELLO))
            router.send(P.ERROR, code="unknown_peer", message="restarted", ack=session._seq)
            hello = router.expect(P.HELLO)
            for old in range(hello.seq - 3, hello.seq):  # refusals of what came before it
                router.send(P.ERROR, code="unknown_peer", message="restarted", ack=old)
            again = router.recv(0.5)
            assert again is None or again.type != P.HELLO, "a HELLO per refused message"
            router.send(P.ERROR, code="unknown_peer", message="restarted again", ack=hello.seq)
            router.expect(P.HELLO)  # a refusal of the HELLO itself or later: say it again
            stop.set()


def test_a_dispatcher_that_forgets_us_late_in_a_run_gets_its_full_connect_timeout():
    """The connect timeout counts from losing the welcome, not from the start of the run: a
    dispatcher restarted on the same address after more than the timeout is answered with a
    HELLO and the session goes on (it gave up at once, seen in a 5-minute soak)."""
    with ScriptedRouter() as router:
        session, role = _session(router.endpoint, connect_timeout_s=1.0, timeout_s=5.0)
        stop = threading.Event()
        with _running(session.run, stop) as (errors, _):
            router.welcome(router.expect(P.HELLO))
            time.sleep(1.5)  # longer than the connect timeout, welcomed all along
            router.send(P.ERROR, code="unknown_peer", message="restarted")
            router.welcome(router.expect(P.HELLO))
            time.sleep(0.3)
            assert session.welcomed and not errors and len(role.welcomes) == 2
            stop.set()


def test_end_finishes_the_session_with_a_bye():
    with ScriptedRouter() as router:
        session, role = _session(router.endpoint)
        with _running(session.run, threading.Event()) as (errors, thread):
            router.welcome(router.expect(P.HELLO))
            router.send(P.END, reason="done")
            router.expect(P.BYE, 2.0)
            thread.join(5)
            assert not thread.is_alive()
    assert not errors


@contextmanager
def _read_with_workers(num: int):
    """(`mmdispatch read --workers num` process, its children's pids: the workers and, maybe,
    multiprocessing's resource tracker) once every worker was welcomed; on exit the process
    and whatever a failure left of its children are killed."""
    with ScriptedRouter() as router:
        proc = _read_process(router.endpoint, "--workers", str(num))
        children: list[int] = []
        try:
            hellos = 0
            while hellos < num:  # every worker is up and serving
                msg = router.recv(60.0)
                assert msg is not None, "a worker never said HELLO"
                if msg.type == P.HELLO:
                    router.welcome(msg)
                    hellos += 1
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
            yield proc, children
        finally:
            proc.kill()
            proc.wait(10)
            for pid in children:
                if _pid_alive(pid):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_workers_of_a_killed_mmdispatch_read_end_with_it():
    """SIGKILL of `mmdispatch read --workers 2` left both workers reading on, orphaned, until
    the dispatcher went away; a restarted reader then ran beside them. Their ending then said
    `reason=SIGTERM`, as if someone had sent one, after a raw Python warning of leaked
    semaphores (probe)."""
    with _read_with_workers(2) as (proc, children):
        assert children
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        alive = children
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in alive if _pid_alive(pid)]
        assert not alive, f"workers {alive} outlived their supervisor"
        _, err = proc.communicate(timeout=30)  # what the workers (and helpers) left in its log
    # Each worker says why it stopped, and multiprocessing's resource tracker, outliving its
    # SIGKILLed parent, no longer finds semaphores of a Queue to warn of in raw Python.
    assert err.count("reason=read_process_gone") == 2, err
    assert "leaked" not in err and "Warning" not in err and "Traceback" not in err, err


@pytest.mark.timeout(90)
def test_a_hangup_stops_mmdispatch_read_and_its_workers_as_sigterm_does():
    """SIGHUP (a closed terminal) killed `read --workers 2` by its default action: its workers,
    ending with their supervisor, each said reason=read_process_gone, and read exited 129."""
    with _read_with_workers(2) as (proc, children):
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert err.count("hung up (SIGHUP); stopping the workers") == 1, err
    assert err.count("reason=SIGTERM") == 2, err  # as the supervisor stopped them
    assert "read_process_gone" not in err and "Traceback" not in err, err


@pytest.mark.timeout(90)
def test_a_hangup_of_one_worker_is_said_as_such_not_as_its_supervisor_s_death():
    """SIGHUP sent to one worker of `read --workers 2` (its supervisor alive) logged
    `reason=read_process_gone`, the line of a supervisor that died (probe)."""
    with _read_with_workers(2) as (proc, children):
        workers = [pid for pid in children if _is_worker(pid)]
        os.kill(workers[0], signal.SIGHUP)
        deadline = time.monotonic() + 30
        while _pid_alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the supervisor ended with one worker"
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert err.count("reason=SIGHUP") == 1 and err.count("reason=SIGTERM") == 1, err
    assert "read_process_gone" not in err and "Traceback" not in err, err
    # ... and `read` says it runs on one short (it said nothing: probe).
    assert err.count("stopped by SIGHUP sent to it alone; the other workers read on") == 1, err


@pytest.mark.timeout(90)
def test_a_worker_stopped_alone_just_before_read_is_stopped_is_still_said():
    """A worker stopped by its own SIGHUP, then `read` stopped before its loop saw that worker
    end (a loaded machine): the worker's line was lost, so nothing said `read` had run short."""
    with _read_with_workers(2) as (proc, children):
        workers = [pid for pid in children if _is_worker(pid)]
        os.kill(proc.pid, signal.SIGSTOP)  # its loop cannot see the worker end before SIGTERM
        try:
            os.kill(workers[0], signal.SIGHUP)
            deadline = time.monotonic() + 30
            while _pid_alive(workers[0]) and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.terminate()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    assert err.count("reason=SIGHUP") == 1 and err.count("reason=SIGTERM") == 1, err
    assert err.count("stopped by SIGHUP sent to it alone; the other workers read on") == 1, err


@pytest.mark.timeout(90)
def test_a_worker_killed_at_shutdown_fails_mmdispatch_read():
    """SIGTERM to `read --workers 2` with one worker stopped (SIGSTOP) killed it after 10 s and
    still exited 0, as if every worker had said BYE."""
    with _read_with_workers(2) as (proc, children):
        workers = [pid for pid in children if _is_worker(pid)]  # not the resource tracker
        os.kill(workers[0], signal.SIGSTOP)
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "did not stop within 10 s of SIGTERM" in err and "Traceback" not in err


def _is_worker(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    return b"spawn_main" in cmdline and b"resource_tracker" not in cmdline


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("address", ["closed port", UNRESOLVABLE])
def test_no_welcome_within_the_connect_timeout_is_an_error_naming_the_address(address):
    if address == "closed port":
        address = f"tcp://127.0.0.1:{free_port()}"
    session, _ = _session(address, connect_timeout_s=1.0, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(Unreachable, match=address.replace(".", r"\.")) as got:
        session.run(threading.Event())
    assert time.monotonic() - start < 5.0
    assert "--connect-timeout" in str(got.value)  # the flag that waits longer, by its name


def test_a_malformed_address_is_an_error_at_once():
    session, _ = _session("tcp://no port here")
    with pytest.raises(Unreachable, match="no port here"):
        session.run(threading.Event())


# -- the reader ----------------------------------------------------------------------------------
def _reader(address: str, **kw) -> ReaderWorker:
    return ReaderWorker(ReaderServiceConfig(dispatcher=address, name="r", timeout_s=5.0, **kw))


def test_a_stopped_reader_says_bye_at_once():
    with ScriptedRouter() as router:
        stop = threading.Event()
        worker = _reader(router.endpoint)
        with _running(worker.run, stop) as (errors, _):
            router.welcome(router.expect(P.HELLO))
            router.expect(P.SHARD_REQUEST)
            stop.set()
            start = time.monotonic()
            router.expect(P.BYE, 2.0)  # long before the 5 s timeout would tell
            assert time.monotonic() - start < 2.0
    assert not errors


def test_a_reader_stops_cleanly_on_end():
    with ScriptedRouter() as router:
        worker = _reader(router.endpoint)
        with _running(worker.run, threading.Event()) as (errors, thread):
            router.welcome(router.expect(P.HELLO))
            router.expect(P.SHARD_REQUEST)
            router.send(P.END, reason="done")
            router.expect(P.BYE, 2.0)
            thread.join(5)
            assert not thread.is_alive()
    assert not errors and worker.ended


def _read_process(address: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                             address, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def test_mmdispatch_read_exits_0_once_every_worker_hears_end():
    with ScriptedRouter() as router:
        proc = _read_process(router.endpoint, "--workers", "2")
        try:
            ended = set()
            while len(ended) < 2:  # each worker: welcomed, then told the job is done
                msg = router.recv(60.0)
                assert msg is not None, "a worker never said HELLO"
                if msg.type == P.HELLO:
                    router.welcome(msg)
                    router.send(P.END, reason="done")
                    ended.add(router.ident)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err


@pytest.mark.parametrize("address", ["closed port", UNRESOLVABLE])
def test_mmdispatch_read_gives_up_after_the_connect_timeout_in_one_line(address):
    if address == "closed port":
        address = f"tcp://127.0.0.1:{free_port()}"
    proc = _read_process(address, "--connect-timeout", "1", "--timeout", "0.5")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(10)
    lines = [ln for ln in err.splitlines() if "mmdispatch read:" in ln]
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and address in lines[0]
    # every reconnect line names the address it tried
    reconnects = [ln for ln in err.splitlines() if "reconnect" in ln]
    assert reconnects and all(address in ln for ln in reconnects)


# -- the trainer client --------------------------------------------------------------------------
def _client(address: str, **kw) -> DispatcherClient:
    cfg = dict(heartbeat_s=0.2, timeout_s=5.0, step_timeout_s=60.0)
    return DispatcherClient(address, 0, 1, 1, config=ClientConfig(**{**cfg, **kw}))


def _welcome_trainer(router: ScriptedRouter, hello: P.Message, *, next_step: int = 0,
                     **fields) -> None:
    router.welcome(hello, role="trainer", heartbeat_s=0.2, world_size=1, next_step=next_step,
                   **fields)


def test_a_trainer_with_no_dispatcher_fails_at_the_connect_timeout_naming_the_address():
    address = f"tcp://127.0.0.1:{free_port()}"
    client = _client(address, connect_timeout_s=1.0, timeout_s=0.3, backoff_max_s=0.1)
    start = time.monotonic()
    try:
        with pytest.raises(Unreachable, match=address):
            next(client)
    finally:
        client.close()
    assert time.monotonic() - start < 10.0  # not the 60 s step timeout


DATASET = {"shards": "ab12", "num_shards": 6, "seed": 5, "mode": "deterministic",
           "global_batch": 8, "token_budget": None}


def test_the_state_carries_the_dataset_and_a_restore_sends_it():
    with ScriptedRouter() as router:
        first = _client(router.endpoint).start()
        try:
            _welcome_trainer(router, router.expect(P.HELLO), next_step=4, dataset=DATASET)
            router.expect(P.CREDIT)
            state = first.state_dict()
        finally:
            first.close()
        router.expect(P.BYE)
        assert state["dataset"] == DATASET
        second = _client(router.endpoint)
        second.load_state_dict(state)
        try:
            second.start()
            hello = router.expect(P.HELLO)
            assert hello["dataset"] == DATASET
            router.send(P.ERROR, code="dataset", ack=hello.seq,
                        message="the journal's dataset differs: seed (journal 5, trainer 6)")
            with pytest.raises(DispatcherError, match=r"seed \(journal 5, trainer 6\)"):
                next(second)
        finally:
            second.close()


def test_a_restored_state_of_another_dataset_is_refused_by_the_client_too():
    with ScriptedRouter() as router:
        client = _client(router.endpoint)
        client.load_state_dict({"next_step": 3, "rank": 0, "world_size": 1,
                                "dataset": {**DATASET, "seed": 6}})
        try:
            client.start()
            hello = router.expect(P.HELLO)
            # a dispatcher that does not compare: it welcomes whatever arrives
            _welcome_trainer(router, hello, next_step=3, dataset=DATASET)
            with pytest.raises(DispatcherError, match=r"seed: saved 6, dispatcher 5"):
                next(client)
        finally:
            client.close()


@pytest.mark.timeout(30)
def test_no_step_within_the_step_timeout_says_what_holds_the_steps():
    """A rank whose peer died timed out with 'no step within N s' and no word of why."""
    with ScriptedRouter() as router:
        client = _client(router.endpoint, step_timeout_s=0.5).start()
        try:
            _welcome_trainer(router, router.expect(P.HELLO))
            with pytest.raises(TimeoutError, match=r"within 0.5 s: .*a rank that stopped "
                                                   r"\(its log: event=trainer_lost\)"):
                next(client)
        finally:
            client.close()


def test_a_commit_the_dispatcher_could_not_journal_fails_at_once_with_its_reason():
    with ScriptedRouter() as router:
        client = _client(router.endpoint)
        client.load_state_dict({"next_step": 4})  # steps 1 and 3 were handed out before
        client.start()
        results: dict[int, object] = {}

        def commit(step: int) -> None:
            try:
                client.commit(step, timeout=20)
                results[step] = "ok"
            except Exception as e:  # noqa: BLE001 - checked below
                results[step] = e

        try:
            _welcome_trainer(router, router.expect(P.HELLO), next_step=4)
            router.expect(P.CREDIT)
            committers = []
            for step in (1, 3):
                committers.append(threading.Thread(target=commit, args=(step,), daemon=True))
                committers[-1].start()
                seqs = router.expect(P.COMMIT)
                assert seqs["step"] == step
                if step == 3:
                    failing = seqs.seq
            start = time.monotonic()
            router.send(P.ERROR, code="internal", ack=failing,
                        message="journal write failed: [Errno 28] No space left on device")
            committers[1].join(5)
            assert time.monotonic() - start < 2.0
            router.send(P.COMMIT, step=1)  # the other commit is journaled and acknowledged
            committers[0].join(5)
        finally:
            client.close()
    assert results[1] == "ok"
    assert isinstance(results[3], DispatcherError)
    assert "No space left on device" in str(results[3]) and "commit(3)" in str(results[3])


def test_readers_and_trainers_get_curve_through_one_check(tmp_path):
    from dispatcher_server.security import create_keypair

    public, _ = create_keypair(str(tmp_path), "peer")
    server_public, _ = create_keypair(str(tmp_path), "server")
    # The public key passed where the secret belongs: refused, naming the file, by both roles.
    worker = _reader("tcp://127.0.0.1:1", secret_file=public, server_public_file=server_public)
    with pytest.raises(ValueError, match=r"peer\.key.*holds no secret key"):
        worker.run(threading.Event())
    client = _client("tcp://127.0.0.1:1", secret_file=public, server_public_file=server_public)
    try:
        with pytest.raises(ValueError, match=r"peer\.key.*holds no secret key"):
            next(client)
    finally:
        client.close()
    with pytest.raises(ValueError, match="both"):
        _reader("tcp://127.0.0.1:1", secret_file=public)


@pytest.mark.parametrize("flags, named", [(["--connect-timeout", "-1"], "--connect-timeout"),
                                          (["--timeout", "0"], "--timeout")])
def test_a_bad_read_setting_is_one_line_naming_the_flag(capsys, flags, named):
    import argparse

    from pipeline import service

    parser = argparse.ArgumentParser()
    service.add_arguments(parser)
    assert service.run(parser.parse_args(["--dispatcher", "tcp://127.0.0.1:1", *flags])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]


def _workers_of(pid: int) -> list[int]:
    """The worker processes of `mmdispatch read` process `pid` (not multiprocessing's helpers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    out = []
    for c in children:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(c)
    return out


def _welcome_hellos(router: ScriptedRouter, n: int) -> None:
    """Welcome the next `n` HELLOs, passing over the other messages of welcomed workers."""
    while n:
        msg = router.recv(60.0)
        assert msg is not None, "no HELLO within 60 s"
        if msg.type == P.HELLO:
            router.welcome(msg)
            n -= 1


@pytest.mark.timeout(180)
def test_mmdispatch_read_starts_again_a_worker_the_kernel_killed_and_sigterm_stops_them_all():
    with ScriptedRouter() as router:
        proc = _read_process(router.endpoint, "--workers", "2")
        try:
            _welcome_hellos(router, 2)
            wait_for(lambda: len(_workers_of(proc.pid)) == 2, 30, "two workers")
            first = _workers_of(proc.pid)
            os.kill(first[0], signal.SIGBUS)  # as a mapped shard truncated in place does
            _welcome_hellos(router, 1)  # the worker started again
            wait_for(lambda: len(_workers_of(proc.pid)) == 2, 30, "the worker started again")
            workers = first + _workers_of(proc.pid)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert re.search(r"worker \d was killed by SIGBUS \(.*--no-map-shards.*\); starting it again "
                     r"\(1/5\)", err), err
    assert "Bus error" in err  # the killed worker's own Python stack (faulthandler)
    # each worker says why it ended in the reader's own log
    assert sorted(re.findall(r"event=stopped worker=(\d) reason=SIGTERM", err)) == ["0", "1"], err
    for pid in workers:  # none left behind
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


@pytest.mark.timeout(120)
def test_a_worker_that_fails_stops_mmdispatch_read_instead_of_reading_on_short_of_it():
    """`read --workers 2` whose worker 0 is refused ran on with worker 1 alone, never exiting,
    its status hiding the failure."""
    with ScriptedRouter() as router:
        proc = _read_process(router.endpoint, "--workers", "2")
        try:
            refused = False
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                msg = router.recv(1.0)
                if msg is not None and msg.type == P.HELLO:
                    router.welcome(msg)
                    if not refused:  # the first worker to say HELLO is refused for good
                        refused = True
                        router.send(P.ERROR, code="version", message="protocol v1 is too old")
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait(10)
    assert refused and proc.returncode == 1, err
    assert "protocol v1 is too old" in err and "failed; stopping the other workers" in err


@pytest.mark.timeout(60)
def test_a_peer_waits_out_a_slow_dispatcher_heartbeat_before_reconnecting():
    """serve --heartbeat 6 beats more slowly than a peer's 5 s silence limit: idle readers
    and trainers dropped and rejoined every 5 s. The limit now covers three of its beats."""
    with ScriptedRouter() as router:
        stop = threading.Event()
        worker = ReaderWorker(ReaderServiceConfig(dispatcher=router.endpoint, name="r",
                                                  timeout_s=1.0))
        with _running(worker.run, stop) as (errors, thread):
            router.welcome(router.expect(P.HELLO), heartbeat_s=1.5)  # silent up to 4.5 s
            t0 = time.monotonic()
            hello = None
            while time.monotonic() - t0 < 3.5 and hello is None:
                msg = router.recv(0.5, heartbeats=False)
                hello = msg if msg is not None and msg.type == P.HELLO else None
            assert hello is None, "reconnected within three of the dispatcher's heartbeats"
            again = router.expect(P.HELLO, 5.0)  # silent past them: it does reconnect
            assert time.monotonic() - t0 >= 4.0 and again is not None
            stop.set()
            thread.join(10)
    assert not errors


@pytest.mark.timeout(60)
def test_two_reads_on_one_host_have_names_the_dispatcher_tells_apart():
    """Both named HOST/0 by default: the dispatcher's joined/left lines could not tell them apart."""
    with ScriptedRouter() as router:
        procs = [_read_process(router.endpoint) for _ in range(2)]
        try:
            names = {router.expect(P.HELLO, 30.0)["name"] for _ in procs}
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(10)
    assert names == {f"{os.uname().nodename}:{p.pid}/0" for p in procs}


@pytest.mark.timeout(120)
def test_sigint_to_mmdispatch_read_stops_its_workers_saying_sigint():
    """The supervisor stopped its workers with SIGTERM whatever it got, so their lines said
    reason=SIGTERM after a Ctrl-C sent to `read` alone."""
    with ScriptedRouter() as router:
        proc = _read_process(router.endpoint, "--workers", "2")
        try:
            _welcome_hellos(router, 2)
            wait_for(lambda: len(_workers_of(proc.pid)) == 2, 30, "two workers")
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert sorted(re.findall(r"event=stopped worker=(\d) reason=SIGINT", err)) == ["0", "1"], err


class _NeverStartedProcess:
    """A worker process that is only recorded; its first start sends `read` SIGTERM."""

    started: list[int] = []

    def __init__(self, target, args, name) -> None:
        self.worker = args[1]
        self.pid, self.exitcode, self.sentinel = -1, 0, None

    def start(self) -> None:
        _NeverStartedProcess.started.append(self.worker)
        if len(self.started) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a Ctrl-C or `timeout` during start-up

    def is_alive(self) -> bool:
        return False

    def join(self, timeout=None) -> None:
        pass


def test_a_signal_while_read_starts_its_workers_starts_no_more():
    """`read --workers 100000` started every worker before it looked at SIGTERM: it ran 18
    minutes past `timeout` and spawned thousands of processes."""
    import argparse
    import multiprocessing
    import types

    from pipeline.service import _supervise

    _NeverStartedProcess.started = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _supervise(argparse.Namespace(workers=50, log_format="text"),
                          types.SimpleNamespace(Process=_NeverStartedProcess, Pipe=multiprocessing.Pipe))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert _NeverStartedProcess.started == [0, 1] and code == 0


@pytest.mark.timeout(120)
def test_workers_that_cannot_reach_the_dispatcher_say_so_once():
    """`read --workers 4` with no dispatcher printed the same line four times, once per worker,
    plus the supervisor's."""
    proc = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                           f"tcp://127.0.0.1:{free_port()}", "--connect-timeout", "2",
                           "--workers", "3"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    reasons = [line for line in lines if re.search(r"worker \d: ", line)]
    assert len(reasons) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) <= 2, proc.stderr


def test_a_session_s_keepalive_heartbeats_only_when_one_is_due():
    """`PeerSession.keepalive`, called from a long header walk in the session's thread
    (`pipeline.keepalive`), sends a heartbeat when one is due, and only then."""
    import zmq

    from dispatcher_server import protocol as P
    from dispatcher_server.session import PeerSession, SessionConfig

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    class Role:
        def hello_fields(self):
            return {"role": "reader"}

    session = PeerSession(SessionConfig(address=f"tcp://127.0.0.1:{port}", heartbeat_s=0.2),
                          Role(), context=ctx, name="reader")
    try:
        session.sock = ctx.socket(zmq.DEALER)
        session.sock.connect(f"tcp://127.0.0.1:{port}")
        session.keepalive()  # not welcomed: nothing to keep alive
        session.welcomed = True
        session.keepalive()  # never sent: due
        session.keepalive()  # just sent: not due
        time.sleep(0.3)
        session.keepalive()
        got = []
        while router.poll(500):
            got.append(P.decode(router.recv_multipart()[1:]).type)
        assert got == [P.HEARTBEAT, P.HEARTBEAT]
    finally:
        session.sock.close(linger=0)
        router.close(linger=0)


def test_a_tick_longer_than_the_silence_allowed_is_no_silence_while_messages_wait():
    """Probe: a reader counting a long clip in its session thread read nothing for seconds; the
    dispatcher's messages waited on its socket, yet it took the dispatcher for silent and
    reconnected, re-reading the shard from the start, for good. Waiting messages are heard."""
    class Slow(_Role):
        slept = False

        def tick(self, session) -> bool:
            if session.welcomed and not self.slept:
                self.slept = True
                time.sleep(1.5)  # past timeout_s=0.5, while the router keeps talking
            return False

    with ScriptedRouter() as router:
        role = Slow()
        session = PeerSession(SessionConfig(address=router.endpoint, timeout_s=0.5, poll_ms=10,
                                            backoff_min_s=0.05, backoff_max_s=0.1), role,
                              name="probe")
        stop = threading.Event()
        with _running(session.run, stop) as (errors, _):
            router.welcome(router.expect(P.HELLO), heartbeat_s=0.1)  # silent after 0.5 s
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                router.send(P.HEARTBEAT)
                time.sleep(0.1)
            assert role.slept and session.num_reconnects == 0
            stop.set()
    assert not errors
