"""A refused CurveZMQ peer hears nothing, so the dispatcher's log must say who was refused and why."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq
import zmq.auth

from dispatcher_server.security import RefusalLog, create_keypair, start_authenticator


def test_refusal_log_names_each_peer_once_and_rate_limits(caplog):
    now = [0.0]
    refusals = RefusalLog(burst=2, window_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="mmdispatch.security"):
        assert refusals.refused("10.0.0.1", "KEYA", "Unknown key")
        assert not refusals.refused("10.0.0.1", "KEYA", "Unknown key")  # the same peer retrying
        assert refusals.refused("10.0.0.2", "KEYB", "Unknown key")
        assert not refusals.refused("10.0.0.3", "KEYC", "Unknown key")  # over the burst
        now[0] = 61.0
        assert refusals.refused("10.0.0.4", "KEYD", "Unknown key")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "address=10.0.0.1" in lines[0] and "key=KEYA" in lines[0] and "--curve-allowed-dir" in lines[0]
    assert "suppressed_since_last=1" in lines[2]


@pytest.mark.timeout(30)
def test_dispatcher_side_logs_an_unlisted_key_once(tmp_path, caplog):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    server_public, server_secret = create_keypair(str(keys), "dispatcher")
    create_keypair(str(keys), "intruder")
    ctx = zmq.Context()
    auth = start_authenticator(ctx, str(allowed))
    server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    try:
        public, secret = zmq.auth.load_certificate(server_secret)
        server.curve_publickey, server.curve_secretkey, server.curve_server = public, secret, True
        port = server.bind_to_random_port("tcp://127.0.0.1")
        cpub, csec = zmq.auth.load_certificate(str(keys / "intruder.key_secret"))
        client.curve_publickey, client.curve_secretkey = cpub, csec
        client.curve_serverkey = public
        with caplog.at_level(logging.WARNING, logger="mmdispatch.security"):
            client.connect(f"tcp://127.0.0.1:{port}")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                    "curve_peer_refused" in r.getMessage() for r in caplog.records):
                time.sleep(0.05)
            time.sleep(1.0)  # the client keeps retrying; the log must not grow
        refused = [r.getMessage() for r in caplog.records if "curve_peer_refused" in r.getMessage()]
        assert len(refused) == 1, refused
        assert f"key={cpub.decode()}" in refused[0] and "address=127.0.0.1" in refused[0]
        assert server.poll(100) == 0  # and nothing got through
    finally:
        client.close(linger=0)
        server.close(linger=0)
        auth.stop()
        ctx.term()


@pytest.mark.timeout(30)
def test_plaintext_peer_failing_the_handshake_is_logged(tmp_path, caplog):
    from dispatcher_server.security import apply_server_curve

    _, server_secret = create_keypair(str(tmp_path), "dispatcher")
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    try:
        with caplog.at_level(logging.WARNING, logger="mmdispatch.security"):
            apply_server_curve(server, server_secret)
            port = server.bind_to_random_port("tcp://127.0.0.1")
            client.connect(f"tcp://127.0.0.1:{port}")
            client.send(b"hello", zmq.NOBLOCK)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                    "curve_handshake_failed" in r.getMessage() for r in caplog.records):
                time.sleep(0.05)
            time.sleep(1.0)  # the client reconnects and fails again: still one line
        lines = [r.getMessage() for r in caplog.records if "curve_handshake_failed" in r.getMessage()]
        assert len(lines) == 1, lines
        assert f"127.0.0.1:{port}" in lines[0] and "plaintext" in lines[0] and "--curve-server-key" in lines[0]
    finally:
        client.close(linger=0)
        server.close(linger=0)
    deadline = time.monotonic() + 5  # the watcher ends with its socket
    while time.monotonic() < deadline and any(t.name == "curve-handshakes" for t in threading.enumerate()):
        time.sleep(0.05)
    assert not any(t.name == "curve-handshakes" for t in threading.enumerate())
    ctx.term()


@pytest.mark.timeout(30)
def test_a_plaintext_trainer_at_a_readers_payload_socket_is_logged_with_the_trainers_fix(
        tmp_path, caplog):
    """A reader's payload socket (direct payloads) logged a failed handshake with the fix for
    the dispatcher's peers; the peers there are trainers, allowed by --payload-allowed-dir."""
    from pipeline.payloads import PayloadCache, PayloadServer

    _, reader_secret = create_keypair(str(tmp_path), "reader")
    allowed = tmp_path / "trainers"
    allowed.mkdir()
    create_keypair(str(allowed), "trainer")
    (allowed / "trainer.key_secret").unlink()
    server = PayloadServer("tcp://127.0.0.1:0", cache=PayloadCache(0), secret_file=reader_secret,
                           allowed_dir=str(allowed))
    client = zmq.Context.instance().socket(zmq.DEALER)
    try:
        with caplog.at_level(logging.WARNING, logger="mmdispatch.security"):
            client.connect(server.endpoint)
            client.send(b"fetch", zmq.NOBLOCK)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                    "curve_handshake_failed" in r.getMessage() for r in caplog.records):
                time.sleep(0.05)
        lines = [r.getMessage() for r in caplog.records if "curve_handshake_failed" in r.getMessage()]
        assert lines and server.endpoint.rsplit(":", 1)[1] in lines[0], lines
        assert "trainers fetching from this reader" in lines[0], lines[0]
        assert "--payload-allowed-dir" in lines[0] and "readers and trainers" not in lines[0]
    finally:
        client.close(linger=0)
        server.close()


def test_keygen_replaces_a_pair_only_when_forced(tmp_path):
    public, _ = create_keypair(str(tmp_path), "reader")
    before = open(public).read()
    with pytest.raises(ValueError, match="--force"):
        create_keypair(str(tmp_path), "reader")
    assert open(public).read() == before
    create_keypair(str(tmp_path), "reader", force=True)
    assert open(public).read() != before


def test_a_refusal_names_the_allow_list_of_the_socket_that_refused_and_stays_whole_in_json(caplog):
    """A reader's payload socket refused with the dispatcher's fix; and JSON logs cut every fix
    at its first apostrophe ("the peer's")."""
    import json

    from dispatcher_server.cliopts import JsonFormatter

    refusals = RefusalLog(allow_list="this reader's --payload-allowed-dir")
    with caplog.at_level(logging.WARNING, logger="mmdispatch.security"):
        assert refusals.refused("10.0.0.1", "KEYA", "Unknown key")
    record = caplog.records[-1]
    fix = json.loads(JsonFormatter().format(record))["fix"]
    assert fix == ("copy the peer's NAME.key into this reader's --payload-allowed-dir, or give the "
                   "peer a key pair that is there")


def test_a_payload_fetch_that_fails_is_a_one_line_error_of_the_trainer():
    """`trainer_client.train` died with 15 frames of traceback over a FetchError."""
    from dispatcher_server.cliopts import is_user_error
    from trainer_client.fetch import FetchError

    assert is_user_error(FetchError("payloads of shard(s) a.tar could not be fetched"))


def test_a_handshake_the_peer_hung_up_on_is_said_in_words():
    """EVENT_HANDSHAKE_FAILED_NO_DETAIL carries an errno (EPIPE from a plaintext peer that
    hung up), which was printed as a protocol code: 'handshake error 0x20'."""
    import errno

    from dispatcher_server.security import handshake_reason

    said = handshake_reason(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.EPIPE)
    assert "closed the connection during the handshake" in said and "0x20" not in said
    assert "plaintext" in handshake_reason(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                           zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
