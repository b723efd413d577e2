"""`reference` payload mode: readers send where each member's bytes lie, trainers read them.

The dispatcher then carries metadata only; these tests hold the mode to the same delivery as
`inline` (same keys, same steps, byte-identical payloads) and check what it refuses.
"""

from __future__ import annotations

import io
import tarfile

import pytest
import zmq

from dispatcher_server import protocol as P
from dispatcher_server.config import FlowConfig
from pipeline.reader import iter_shard
from tests.test_service import consume, dispatcher, make_config, readers, shards  # noqa: F401
from trainer_client.client import ShardFiles


def test_spans_locate_every_item_in_its_shard_file(shards):
    seen = 0
    for url in shards:
        with open(url, "rb") as f:
            for rec in iter_shard(url, spans=True):
                assert set(rec.spans) == {it.member for it in rec.items}
                for member, (offset, size) in rec.spans.items():
                    f.seek(offset)
                    assert f.read(size) == rec.members[member]
                    seen += 1
    assert seen > 20


def test_spans_follow_long_names_and_refuse_gzip(tmp_path):
    # A GNU long name puts an extra header before the member: offsets must count it.
    path = tmp_path / "long.tar"
    name = "d" * 120 + "/sample"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for suffix, data in (("txt", b"hello there"), ("wav", _wav(800))):
            info = tarfile.TarInfo(f"{name}.{suffix}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (rec,) = list(iter_shard(str(path), spans=True))
    offset, size = rec.spans["wav"]
    assert path.read_bytes()[offset:offset + size] == _wav(800)
    with pytest.raises(ValueError, match="uncompressed"):
        next(iter_shard(str(tmp_path / "x.tar.gz"), spans=True))


def _wav(frames: int) -> bytes:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\1" * frames)
    return buf.getvalue()


def test_reference_path_and_ref_round_trip():
    ref = P.pack_ref(b"/data/a.tar", 1536, 70000)
    assert P.unpack_ref(memoryview(ref)) == (b"/data/a.tar", 1536, 70000, 0)  # version unknown
    stamped = P.unpack_ref(P.pack_ref(b"/data/a.tar", 1536, 70000, P.file_stamp(4096, 7)))
    assert stamped.stamp == P.file_stamp(4096, 7) != 0 and stamped.size == 70000
    assert P.refs_point_into([memoryview(ref)], b"/data/a.tar")
    assert not P.refs_point_into([memoryview(ref)], b"/data/b.tar")
    assert not P.refs_point_into([memoryview(ref[:-1])], b"/data/a.tar")
    assert P.reference_path("file:///data/a.tar") == "/data/a.tar"
    assert P.reference_path("file:/data/a.tar") == "/data/a.tar"  # trainers cannot open file:
    assert P.reference_path("file:rel/a.tar") == "rel/a.tar"
    for url in ("pipe:curl -s http://x/a.tar", "s3://bucket/a.tar", "/data/a.tar.gz"):
        with pytest.raises(ValueError, match="--payloads inline\\)"):
            P.reference_path(url)
    # direct: readers read remote objects back by range, so the URL is the reference's path
    assert P.reference_path("s3://bucket/a.tar", "direct") == "s3://bucket/a.tar"
    for url in ("pipe:curl -s http://x/a.tar", "https://x/a.tar.gz"):
        with pytest.raises(ValueError, match="--payloads direct.*--payloads inline"):
            P.reference_path(url, "direct")
    with pytest.raises(P.ProtocolError):
        P.unpack_ref(b"\0" * 24)


def test_server_config_refuses_shards_trainers_cannot_read(shards):
    with pytest.raises(ValueError, match="is a command.s stream"):
        make_config(["pipe:cat a.tar"], payloads="reference")
    with pytest.raises(ValueError, match="payloads must be one of"):
        make_config(shards, payloads="by-carrier-pigeon")


def _contents(step) -> list:
    """Per micro-batch: (step, keys, text ids, {phase: [(key, member, payload bytes)]})."""
    return [(step.step, mb.keys, [t.tolist() for t in mb.text_ids],
             {p: [(k, m, bytes(b)) for k, m, b in zip(e.sample_keys, e.members, e.payloads)]
              for p, e in mb.encoders.items()}) for mb in step.microbatches]


def _deliver(endpoint: str, world_size: int) -> dict[int, list]:
    return {r: [mb for step in steps for mb in step] for r, steps in
            consume(endpoint, world_size, record=_contents).items()}


def test_reference_mode_delivers_exactly_what_inline_delivers(shards):
    runs = {}
    for mode in ("inline", "reference"):
        with dispatcher(make_config(shards, payloads=mode)) as srv, readers(srv.reader_endpoint, 2):
            runs[mode] = _deliver(srv.trainer_endpoint, 3)
            bytes_in = srv.metrics.bytes_in.labels("reader")._value.get()
        runs[mode + "_bytes_in"] = bytes_in
    assert runs["reference"] == runs["inline"]  # same steps, keys, text ids and payload bytes
    payload = sum(len(b) for got in runs["inline"].values() for *_, enc in got
                  for items in enc.values() for _, _, b in items)
    assert payload > 100_000
    # Payload bytes no longer pass through the dispatcher: what readers send shrinks by them.
    assert runs["reference_bytes_in"] < runs["inline_bytes_in"] - 0.9 * payload


def test_reference_outside_the_assigned_shard_is_refused(shards, tmp_path):
    """A reader naming another file (a bug or a hostile peer) gets its shard taken back, and
    the trainers never read what it named; honest readers still deliver every sample."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not training data" * 100)
    config = make_config(shards, payloads="reference", world_size=1,
                         flow=FlowConfig(max_buffered_samples=256, num_inflight_shards=1,
                                         credit_batch=8))
    with dispatcher(config) as srv:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        P.socket_limits(sock)
        sock.connect(srv.reader_endpoint)
        try:
            sock.send_multipart(P.encode(P.HELLO, seq=1, role="reader", name="rogue"))
            assert _recv(sock)["payloads"] == "reference"
            sock.send_multipart(P.encode(P.SHARD_REQUEST, seq=2))
            assign = _wait_for(sock, P.SHARD_ASSIGN)
            _wait_for(sock, P.CREDIT)
            ref = P.pack_ref(str(secret).encode(), 0, 17)
            header = ["k0", 0, 1, 1 + 4, P.blank_tokens(1), [["image", "jpg", 16, 4, {}]]]
            sock.send_multipart(P.encode(P.SAMPLES, seq=3, frames=[ref],
                                         assign_id=assign["assign_id"], samples=[header],
                                         sizes=[len(ref)]))
            assert _wait_for(sock, P.CANCEL)["assign_id"] == assign["assign_id"]
        finally:
            sock.close(linger=0)
        assert srv.metrics.errors.labels("bad_reference")._value.get() == 1
        with readers(srv.reader_endpoint, 1):
            got = _deliver(srv.trainer_endpoint, 1)
    keys = [k for _, keys, _, _ in got[0] for k in keys]
    assert "k0" not in keys and len(keys) == len(set(keys)) == 90


def _recv(sock, timeout_ms: int = 5000) -> P.Message:
    assert sock.poll(timeout_ms), "no reply from the dispatcher"
    return P.decode(sock.recv_multipart(copy=False))


def _wait_for(sock, type_: str) -> P.Message:
    for _ in range(50):
        msg = _recv(sock)
        if msg.type == type_:
            return msg
    raise AssertionError(f"no {type_} within 50 messages")


@pytest.mark.parametrize("mapped", [True, False])
def test_shard_files_read_in_place_and_explain_missing_bytes(tmp_path, mapped):
    path = tmp_path / "s.tar"
    path.write_bytes(bytes(range(256)) * 8)
    other = tmp_path / "t.tar"
    other.write_bytes(b"t" * 100)
    refs = [P.pack_ref(str(path).encode(), 10, 5), P.pack_ref(str(path).encode(), 600, 0),
            P.pack_ref(str(other).encode(), 7, 3), P.pack_ref(str(path).encode(), 2000, 48)]
    files = ShardFiles(max_open=1, mapped=mapped)  # one file held open at a time: reopened
    views = files.read([memoryview(r) for r in refs])
    data = path.read_bytes()
    assert [bytes(v) for v in views] == [data[10:15], b"", b"ttt", data[2000:2048]]
    assert all(v.readonly for v in views) == mapped
    files.close()
    assert bytes(views[-1]) == data[2000:2048]  # views outlive the reader
    # A file rewritten since it was opened is read again, not served stale.
    path.write_bytes(b"x" * 4096)
    (view,) = files.read([memoryview(refs[-1])])
    assert bytes(view) == b"x" * 48
    path.write_bytes(bytes(range(256)) * 8)
    short = P.pack_ref(str(path).encode(), 2040, 48)
    with pytest.raises(OSError, match="changed on disk"):
        files.read([memoryview(short)])
    gone = P.pack_ref(str(tmp_path / "missing.tar").encode(), 0, 4)
    with pytest.raises(OSError) as e:  # not mounted here, or removed while the job reads it
        files.read([memoryview(gone)])
    assert str(e.value) == (
        f"payloads='reference': this trainer cannot open shard '{tmp_path / 'missing.tar'}' (No "
        "such file or directory): it is not mounted here at the same path as on the data nodes, "
        "or it was removed or renamed since its reader read it (leave shards in place while a "
        "job reads them)")
    files.close()
    files.close()  # a second close (client teardown after an error) must not raise


@pytest.mark.parametrize("mapped", [True, False])
def test_a_shard_replaced_after_its_reader_read_it_is_refused_not_read(tmp_path, mapped):
    """A shard replaced under the same name (os.replace; a longer file) was read at the old
    offsets: other bytes, silently. References carry the version their reader read."""
    import os

    from pipeline.service import sample_header
    from pipeline.shards import MappedShard, read_range, stream_stamp

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(png, "PNG")
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as t:
        for i in range(3):
            info = tarfile.TarInfo(f"k{i}.png")
            info.size = len(png.getvalue())
            t.addfile(info, io.BytesIO(png.getvalue()))
    shard = MappedShard(str(path))
    stamp = stream_stamp(shard)
    st = os.stat(path)
    assert stamp == P.file_stamp(st.st_size, st.st_mtime_ns) != 0
    rec = next(iter_shard(str(path), spans=True))
    _, frames = sample_header(rec, str(path).encode(), stamp)
    files = ShardFiles(mapped=mapped)
    assert [bytes(v) for v in files.read([memoryview(frames[0])])] == [png.getvalue()]
    ref = P.unpack_ref(frames[0])
    assert read_range(str(path), ref.offset, ref.size, ref.stamp) == png.getvalue()
    new = tmp_path / "new.tar"
    new.write_bytes(b"Z" * 8192)
    os.replace(new, path)
    if not mapped:  # a descriptor opened before still reads the version counted: its bytes
        (held,) = files.read([memoryview(frames[0])])
        assert bytes(held) == png.getvalue()
        files.close()
        files = ShardFiles(mapped=mapped)
    with pytest.raises(OSError, match=r"changed on disk since its reader read it") as refused:
        files.read([memoryview(frames[0])])
    # a node's own copy made without its times fails the same way: the line says how to copy
    assert "cp -p, rsync -a" in str(refused.value)
    with pytest.raises(OSError, match=r"changed on disk since its reader read it"):
        read_range(str(path), ref.offset, ref.size, ref.stamp)  # a direct-mode cache miss
    files.close()
