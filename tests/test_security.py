"""Hostile input and peers: fuzzed frames (atheris, hypothesis), a rogue DEALER against a live
dispatcher process, CurveZMQ refusing unlisted keys, owner-only key files, loopback defaults.
atheris (coverage-guided, seeded with one valid message of every type) runs in a subprocess
for a bounded number of inputs; hypothesis adds mutations of valid messages, through the
trainer's `decode_step` too.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import struct
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher_server import protocol as P
from dispatcher_server.config import CurveConfig
from dispatcher_server.security import create_keypair
from mmdispatch import cli
from tests import servicekit as K
from tests.test_service import (
    all_keys, consume, dispatcher, flat_keys, make_config, readers,
    shards,  # noqa: F401 - fixture
)


# -- valid messages of every kind, for seeds and mutations -------------------------------------
def _step_frames() -> list[bytes]:
    from dispatcher_server.batching import Sample, build_batch, rank_message
    from dispatcher_server.planner import PlannerConfig, Topology, plan_step

    rng = np.random.default_rng(2)
    samples = []
    for i in range(6):
        items = ([P.ItemHeader("image", "jpg", 64, 16, {"w": 8})] if i % 2
                 else [P.ItemHeader("audio", "wav", 50, 10, {})])
        payloads = [memoryview(bytes([i]) * 20)]
        text_len = int(rng.integers(1, 30))
        samples.append(Sample(key=f"k{i}", pos=0, index=i, text_len=text_len,
                              llm_len=text_len + items[0].llm_len,
                              tokens=P.blank_tokens(text_len), items=items,
                              payloads=payloads, nbytes=20))
    batch = build_batch(samples)
    plan = plan_step(batch.inputs, Topology(world_size=2, ranks_per_node=1),
                     PlannerConfig(num_microbatches=2))
    return [bytes(memoryview(f)) for f in rank_message(batch, plan, step=3, epoch=0, rank=1, seq=9)]


def valid_messages() -> list[list[bytes]]:
    out = [
        P.encode(P.HELLO, seq=1, role="trainer", rank=0, world_size=2, next_step=None, prefetch=2),
        P.encode(P.WELCOME, seq=1, role="reader", ack=1, heartbeat_s=0.5),
        P.encode(P.ERROR, code="x", message="y"),
        P.encode(P.HEARTBEAT),
        P.encode(P.SHARD_ASSIGN, assign_id=1, shard="a.tar", pos=3, epoch=0, start_index=5),
        P.encode(P.SAMPLES, frames=[b"\xff\xd8jpeg", b"RIFFwav"], assign_id=2, samples=[
            ["k1", 3, 10, 74, bytes(range(50)), [["image", "jpg", 256, 64, {"width": 32}]]],
            ["k2", 4, 1, 11, b"\x01\0\0\0\x01", [["audio", "wav", 40, 10, {"sr": 16000}]]]]),
        P.encode(P.SHARD_DONE, assign_id=1, count=9, skipped=[["k", "bad_image", 3]]),
        P.encode(P.CREDIT, upto=5, received=3),
        P.encode(P.END, next_step=4, reason="max_epochs"),
        P.encode(P.COMMIT, step=3),
        _step_frames(),
        P.encode(P.READERS, readers=[["tcp://10.0.0.5:7000", ""]]),
        P.encode(P.FETCH, frames=[P.pack_ref(b"/d/a.tar", 512, 3)], id=1, sizes=[32]),
        P.encode(P.PAYLOADS, frames=[b"abc"], id=1, sizes=[3]),
    ]
    return [[bytes(memoryview(f)) for f in m] for m in out]


def _pack(frames: list[bytes]) -> bytes:
    """Fuzzer input layout: u8 frame count, then per frame u16 length + bytes."""
    out = bytearray([len(frames) & 0xFF])
    for f in frames:
        out += struct.pack("<H", min(len(f), 0xFFFF)) + f[:0xFFFF]
    return bytes(out)


def _unpack(data: bytes) -> list[bytes]:
    if not data:
        return []
    frames, at = [], 1
    for _ in range(data[0]):
        n = int.from_bytes(data[at:at + 2], "little")
        frames.append(data[at + 2:at + 2 + n])
        at += 2 + n
    return frames


def _decode_all(frames: list) -> None:
    """Decode, then (for a STEP) build the trainer's tensors: only ProtocolError may escape."""
    try:
        msg = P.decode(frames)
        if msg.type == P.STEP:
            from trainer_client.client import decode_step

            decode_step(msg)
    except P.ProtocolError:
        pass


# -- fuzzing -----------------------------------------------------------------------------------
#: The atheris harness runs in a fresh interpreter (atheris owns the process, and only modules
#: imported under `instrument_imports` give it coverage); same input layout as `_pack`.
ATHERIS_HARNESS = """
import sys
import atheris
import msgpack  # a C extension: imported first, so only our module gets instrumented
with atheris.instrument_imports(include=["dispatcher_server.protocol"]):
    from dispatcher_server import protocol as P

def one(data):
    frames, at = [], 1
    for _ in range(data[0] if data else 0):
        n = int.from_bytes(data[at:at + 2], "little")
        frames.append(data[at + 2:at + 2 + n])
        at += 2 + n
    try:
        P.decode(frames)
    except P.ProtocolError:
        pass

atheris.Setup(sys.argv, one)
atheris.Fuzz()
"""


def test_atheris_fuzzes_the_decoder_from_valid_seeds(tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, m in enumerate(valid_messages()):
        (corpus / f"seed{i}").write_bytes(_pack(m))
    # Linux keeps a process's peak RSS across fork and exec, so the harness starts with this
    # pytest process's peak as its own (over 2 GB after the suite's large-payload tests):
    # libFuzzer's memory limit (2 GB by default) is counted on top of it.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    proc = subprocess.run(
        [sys.executable, "-c", ATHERIS_HARNESS, "-atheris_runs=100000", "-max_total_time=8",
         "-max_len=4096", "-seed=1", f"-rss_limit_mb={inherited_mb + 2048}", str(corpus)],
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    out = proc.stdout + proc.stderr
    # An escaped exception makes atheris print its traceback and exit non-zero.
    assert proc.returncode == 0, out[-3000:]
    assert "Done " in out and "no interesting inputs" not in out, out[-2000:]


_mutation = st.tuples(st.sampled_from(["flip", "truncate", "drop", "dup", "swap", "splice"]),
                      st.integers(0, 1 << 30), st.integers(0, 255))


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 13), st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_mutated_valid_messages_raise_only_protocol_error(which, mutations):
    frames = [bytearray(f) for f in VALID[which]]
    for kind, at, byte in mutations:
        if not frames:
            break
        i = at % len(frames)
        f = frames[i]
        if kind == "flip" and f:
            f[at % len(f)] ^= byte or 1
        elif kind == "truncate":
            frames[i] = f[:at % (len(f) + 1)]
        elif kind == "drop":
            del frames[i]
        elif kind == "dup":
            frames.insert(i, bytearray(f))
        elif kind == "swap" and len(frames) > 1:
            j = (at // 7) % len(frames)
            frames[i], frames[j] = frames[j], frames[i]
        elif kind == "splice" and f:
            # Re-encode the header with one field replaced: reaches the deep validators.
            try:
                header = msgpack.unpackb(bytes(frames[0]), raw=False)
            except Exception:  # noqa: BLE001 - already broken: fine
                continue
            if isinstance(header, dict) and header:
                name = sorted(header, key=str)[at % len(header)]
                header[name] = [None, -1, 2**40, "x", b"", [], {}, 1.5, True][byte % 9]
                frames[0] = bytearray(msgpack.packb(header, use_bin_type=True))
    _decode_all(frames)


VALID = valid_messages()


# -- a rogue peer against a live dispatcher process ---------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return K.make_corpus(str(tmp_path_factory.mktemp("rogue")), num_copies=10, base_samples=60,
                         base_shards=1)


def _rogue(endpoint: str, stop: threading.Event, sent: dict, seed: int) -> None:
    """Random frames, wrong versions, oversized and out-of-order messages; never reads replies."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)

    def send(kind: str, frames: list) -> None:
        sock.send_multipart(frames)
        sent[kind] = sent.get(kind, 0) + 1

    hdr = lambda **h: msgpack.packb({"v": P.VERSION, "seq": 1, **h})  # noqa: E731
    try:
        send("too_large", [P.encode(P.HEARTBEAT)[0]] + [b""] * (P.DEFAULT_LIMITS.max_frames + 1))
        while not stop.is_set():
            for _ in range(50):
                r = rng.random()
                if r < 0.4:
                    send("random", [rng.randbytes(rng.randint(0, 200))
                                    for _ in range(rng.randint(1, 4))])
                elif r < 0.5:
                    v = rng.choice([0, P.VERSION + 1, 99, str(P.VERSION)])
                    send("version", [msgpack.packb({"v": v, "seq": 1, "type": P.HELLO,
                                                    "role": "trainer"})])
                elif r < 0.6:
                    send("unknown_type", [hdr(type=rng.choice(["steal", "x" * 500, "STEP"]))])
                elif r < 0.8:  # well formed but never said hello
                    send("unknown_peer", rng.choice([
                        P.encode(P.STEP, frames=[b""], step=0, epoch=0, rank=0, world_size=2,
                                 microbatches=[]),
                        P.encode(P.COMMIT, step=rng.randint(0, 10**6)),
                        P.encode(P.CREDIT, upto=10**9, received=10**9),
                        P.encode(P.SAMPLES, frames=[b"x"], assign_id=1,
                                 samples=[["evil", 0, 1, 2, P.blank_tokens(1), [["image", "j", 1, 1, {}]]]]),
                        P.encode(P.SHARD_DONE, assign_id=1, count=0, skipped=[])]))
                else:
                    send("malformed", [hdr(type=P.COMMIT, step="zero")])
            time.sleep(0.01)
    finally:
        sock.close(linger=-1)  # what was counted as sent does reach the dispatcher, however late
    # Larger than the socket's MAXMSGSIZE: libzmq drops the connection (counted nowhere).
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        # (max_frame_bytes + 1 is within WIRE_SLACK: libzmq took all 256 MiB of it in, and a
        # loaded machine sampled the dispatcher's RSS while it held them: "grew 426 MiB")
        send("oversized", [P.encode(P.HEARTBEAT)[0],
                           b"\0" * (P.DEFAULT_LIMITS.max_frame_bytes + P.WIRE_SLACK + 1)])
    finally:
        sock.close(linger=2000)


def test_rogue_dealers_cannot_crash_grow_or_disturb_the_dispatcher(corpus, tmp_path):
    keys = K.corpus_keys(corpus)
    with K.Stack(corpus, str(tmp_path), num_readers=2, metrics=True) as st:
        pid = st.server.pid
        K.wait_for(lambda: K.scrape(st.metrics_port).get(
            'mmdispatch_peers_connected{role="reader"}') == 2, 20, "readers")
        rss0 = K.rss_bytes(pid)
        stop, sent_t, sent_r = threading.Event(), {}, {}
        rogues = [threading.Thread(target=_rogue, args=(st.ready[role], stop, sent, seed), daemon=True)
                  for role, sent, seed in (("trainers", sent_t, 1), ("readers", sent_r, 2))]
        for t in rogues:
            t.start()
        trainers = K.Trainers(st.ready["trainers"], K.WORLD)
        peak = rss0
        try:
            while any(t.is_alive() for t in trainers.threads):
                peak = max(peak, K.rss_bytes(pid))
                time.sleep(0.05)
            got = trainers.join(60)
        finally:
            stop.set()
            trainers.close()
            for t in rogues:
                t.join(30)
        def total(m: dict) -> float:
            return sum(v for k, v in m.items() if k.startswith("mmdispatch_errors_total"))

        seen = [-1.0]

        def settled() -> bool:  # the backlog of rogue messages is worked off
            now = total(K.scrape(st.metrics_port))
            done, seen[0] = now == seen[0], now
            time.sleep(0.3)
            return done

        K.wait_for(settled, 20, "error counts to settle")
        assert st.server.poll() is None, "the dispatcher died"
        metrics = K.scrape(st.metrics_port)
        peak = max(peak, K.rss_bytes(pid))
    K.audit(got, keys, num_microbatches=K.M)
    sent = {k: sent_t.get(k, 0) + sent_r.get(k, 0) for k in set(sent_t) | set(sent_r)}
    assert sent["random"] > 100 and sent["unknown_peer"] > 50
    errors = {k[len('mmdispatch_errors_total{kind="'):-2]: v for k, v in metrics.items()
              if k.startswith("mmdispatch_errors_total")}
    # Every refused message is counted by kind (random bytes land in several kinds).
    assert errors.get("version", 0) >= sent["version"]
    assert errors.get("unknown_peer", 0) >= sent["unknown_peer"]
    assert errors.get("too_large", 0) >= sent["too_large"]
    assert errors.get("malformed", 0) >= sent["malformed"]
    assert sum(errors.values()) >= sum(v for k, v in sent.items() if k != "oversized")
    assert metrics["mmdispatch_samples_skipped_total"] == 0  # nothing injected got in
    # 48 MiB of working set under attack, plus the 16 MiB of freed blocks glibc may keep
    # (`serve --malloc-keep-mb`, default 16): growth must not scale with the rogue traffic.
    assert peak - rss0 < 64 << 20, f"dispatcher RSS grew {(peak - rss0) >> 20} MiB under attack"


# -- CurveZMQ ----------------------------------------------------------------------------------
def _silent(endpoint: str, frames_list: list[list[bytes]], *, curve: tuple | None,
            wait_s: float = 1.5) -> bool:
    """Send from a DEALER (optionally CURVE client keys); True if nothing at all comes back."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
        sock.connect(endpoint)
        for frames in frames_list:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass  # no completed handshake, no pipe: which is the point
        return sock.poll(int(wait_s * 1000)) == 0
    finally:
        sock.close(linger=0)


def test_curve_refuses_unlisted_peers_on_both_endpoints(shards, tmp_path):
    import zmq.auth

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    names = ("server", "reader", "trainer", "intruder")
    for name in names:
        create_keypair(str(keys), name)
    for name in ("reader", "trainer"):
        shutil.copy(keys / f"{name}.key", allowed)
    pub = {n: zmq.auth.load_certificate(str(keys / f"{n}.key_secret")) for n in names}
    server_public = str(keys / "server.key")
    curve = CurveConfig(server_secret_file=str(keys / "server.key_secret"),
                        allowed_keys_dir=str(allowed))
    cfg = make_config(shards, world_size=1, curve=curve, max_steps=4)
    inject = [P.encode(P.HELLO, seq=1, role="reader", name="intruder"),
              P.encode(P.SHARD_REQUEST, seq=2),
              P.encode(P.SAMPLES, frames=[b"x"], assign_id=1,
                       samples=[["evil", 0, 1, 2, P.blank_tokens(1), [["image", "j", 1, 1, {}]]]])]
    hello_trainer = [P.encode(P.HELLO, seq=1, role="trainer", rank=0, world_size=1)]
    with dispatcher(cfg) as srv:
        intruder = (*pub["intruder"], pub["server"][0])
        wrong_server = (*pub["trainer"], pub["intruder"][0])  # allowed key, impostor server key
        for endpoint, frames in ((srv.reader_endpoint, inject),
                                 (srv.trainer_endpoint, hello_trainer)):
            assert _silent(endpoint, frames, curve=intruder)  # cannot read
            assert _silent(endpoint, frames, curve=None)  # plaintext: no handshake at all
            assert _silent(endpoint, frames, curve=wrong_server, wait_s=0.5)
        registry = srv.metrics.registry
        assert not srv.readers and all(s.ident is None for s in srv.slots)  # cannot connect
        assert registry.get_sample_value("mmdispatch_samples_in_total") == 0  # cannot inject
        with readers(srv.reader_endpoint, 1, secret_file=str(keys / "reader.key_secret"),
                     server_public_file=server_public):
            got = consume(srv.trainer_endpoint, 1, secret_file=str(keys / "trainer.key_secret"),
                          server_public_file=server_public)
    delivered = flat_keys(got)
    assert len(delivered) == 4 * 8 and set(delivered) <= set(all_keys(shards))
    assert "evil" not in delivered


def test_secret_keys_are_owner_only_and_public_keys_readable_whatever_the_umask(tmp_path):
    """The public key is copied to peers and read by a container's uid: 0644 (it was 0600
    like the secret); the secret stays 0600."""
    for umask in (0, 0o077):
        old = os.umask(umask)
        try:
            assert cli.main(["keygen", "node", "--dir", str(tmp_path / "new"), "--force"]) == 0
        finally:
            os.umask(old)
        assert os.stat(tmp_path / "new" / "node.key_secret").st_mode & 0o777 == 0o600
        assert os.stat(tmp_path / "new" / "node.key").st_mode & 0o777 == 0o644
        assert os.stat(tmp_path / "new").st_mode & 0o077 == 0  # a directory it created: owner-only
    assert os.stat(tmp_path / "new").st_mode & 0o077 == 0  # a directory it created: owner-only


def test_serve_binds_loopback_unless_told_otherwise(shards, tmp_path):
    from mmdispatch import serve as serve_cmd

    assert serve_cmd.OPTIONS["reader_bind"][1].startswith("tcp://127.0.0.1:")
    assert serve_cmd.OPTIONS["trainer_bind"][1].startswith("tcp://127.0.0.1:")
    assert serve_cmd.OPTIONS["metrics_host"][1] == "127.0.0.1"
    assert serve_cmd.OPTIONS["metrics_port"][1] == 0  # no HTTP endpoint unless asked
    proc, ready = K.serve(shards, world_size=1, extra=["--max-steps", "1"])
    K.kill(proc)
    assert ready["readers"].startswith("tcp://127.0.0.1:")
    assert ready["trainers"].startswith("tcp://127.0.0.1:")
    assert ready["metrics_port"] == 0
    # Wider is an explicit choice, and then it is honoured.
    proc, ready = K.serve(shards, world_size=1, extra=["--max-steps", "1",
                                                      "--trainer-bind", "tcp://0.0.0.0:0"])
    K.kill(proc)
    assert ready["trainers"].startswith("tcp://0.0.0.0:")
    assert ready["readers"].startswith("tcp://127.0.0.1:")


def test_a_secret_key_given_as_the_server_key_works_and_is_warned_once(tmp_path, caplog):
    """--curve-server-key dispatcher.key_secret holds the public key too, so it is taken; but
    the secret need not be on readers and trainers, which is said once."""
    from dispatcher_server import cliopts

    public, secret = create_keypair(str(tmp_path), "dispatcher")
    mine, _ = create_keypair(str(tmp_path), "reader")
    with caplog.at_level("WARNING", logger="mmdispatch"):
        cliopts.check_curve_pair(str(tmp_path / "reader.key_secret"), public)
        assert "curve_server_key_is_secret" not in caplog.text
        cliopts.check_curve_pair(str(tmp_path / "reader.key_secret"), secret)
        cliopts.check_curve_pair(str(tmp_path / "reader.key_secret"), secret)
    assert caplog.text.count("event=curve_server_key_is_secret") == 1
    assert "public NAME.key" in caplog.text and "need not be copied" in caplog.text


def test_a_secret_key_readable_by_every_user_is_warned_of_once_naming_chmod_600(
        tmp_path, caplog, monkeypatch):
    from dispatcher_server import cliopts

    monkeypatch.delenv("MMDISPATCH_OPEN_SECRETS_SAID", raising=False)
    public, secret = create_keypair(str(tmp_path), "dispatcher")
    _, mine = create_keypair(str(tmp_path), "reader")
    with caplog.at_level("WARNING", logger="mmdispatch"):
        cliopts.check_curve_pair(mine, public)  # 0600, as keygen writes it: nothing said
        assert "curve_secret_readable" not in caplog.text
        os.chmod(mine, 0o666)
        for _ in range(3):
            cliopts.check_curve_pair(mine, public)
    lines = [r.getMessage() for r in caplog.records if "curve_secret_readable" in r.getMessage()]
    assert len(lines) == 1 and mine in lines[0] and f"chmod 600 {mine}" in lines[0]


@pytest.mark.parametrize("given,words", [
    ("tar", ["--curve-secret", "shard.tar", "is no CurveZMQ key file", "NAME.key_secret"]),
    ("public", ["--curve-secret", "dispatcher.key'", "holds no secret key",
                "pass NAME.key_secret, not the public NAME.key"]),
])
def test_a_wrong_file_as_the_servers_secret_is_named_with_the_fix(tmp_path, given, words):
    from dispatcher_server.security import apply_server_curve

    public, _ = create_keypair(str(tmp_path), "dispatcher")
    (tmp_path / "shard.tar").write_bytes(b"\0" * 1024)
    path = {"tar": str(tmp_path / "shard.tar"), "public": public}[given]
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        with pytest.raises(ValueError) as e:
            apply_server_curve(sock, path)
    finally:
        sock.close(linger=0)
    for word in words:
        assert word in str(e.value)


def test_an_unreadable_secret_key_names_the_flag_and_the_fix(tmp_path, monkeypatch):
    from dispatcher_server import security

    _, secret = create_keypair(str(tmp_path), "dispatcher")

    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(security.zmq.auth, "load_certificate", denied)
    with pytest.raises(ValueError, match=r"--curve-secret '.*dispatcher.key_secret' cannot be read "
                                         r"\(Permission denied\): give a NAME.key_secret file"):
        security.load_secret(secret)


@pytest.mark.timeout(60)
def test_a_frame_filled_to_the_limit_passes_curvezmq_too():
    """CurveZMQ's MAXMSGSIZE check counts a frame's box, 33 bytes more than the frame: senders
    fill frames up to `max_frame_bytes` (`coalesce`, a STEP's data), and such a frame was
    dropped with its connection only where it was encrypted (the peer reconnected for ever)."""
    limits = P.Limits(max_frame_bytes=1000)
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        for sock in (server, client):
            P.socket_limits(sock, limits)
        server.curve_server, server.curve_secretkey = True, server_secret
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.curve_serverkey, client.curve_publickey = server_public, client_public
        client.curve_secretkey = client_secret
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send_multipart([b"head", b"x" * limits.max_frame_bytes])
        assert server.poll(10_000), "the full frame never arrived"
        ident, head, body = server.recv_multipart()
        assert (head, len(body)) == (b"head", limits.max_frame_bytes)
        server.send_multipart([ident, b"y" * limits.max_frame_bytes])  # and the other way
        assert client.poll(10_000) and len(client.recv()) == limits.max_frame_bytes
    finally:
        server.close(linger=0)
        client.close(linger=0)
        ctx.term()
