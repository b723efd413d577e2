"""Video: header counts equal the sampling formula, headers never decode, bad clips are skipped
with their reason, video items run in the vision phase, and trainer patches match the count."""

from __future__ import annotations

import fractions
import io
import json
import math
import sys

import numpy as np
import pytest

from mmdispatch.cli import main
from pipeline.counting import CountError, ImageConfig, smart_resize
from pipeline.errors import ErrorPolicy, ErrorStats
from pipeline.gendata import generate, video_clip
from pipeline.reader import ReaderConfig, iter_samples, iter_shard
from pipeline.records import MODALITY_PHASE
from pipeline.video import (
    VideoConfig, count_video, frame_indices, read_header, sampled_frames, video_lengths, video_patches,
)
from tests.badcorpus import _half, jpeg, mp4_with, tar_bytes, wav

av = pytest.importorskip("av")


def _qwen_nframes(total: int, native_fps: float, fps: float = 2.0, min_frames: int = 4,
                  max_frames: int = 768) -> int:
    """qwen_vl_utils' smart_nframes (fps path, FRAME_FACTOR 2) written out; where it raises (fewer
    than 2 frames), one pair."""
    least = math.ceil(min_frames / 2) * 2
    most = math.floor(min(max_frames, total) / 2) * 2
    n = min(min(max(total / native_fps * fps, least), most), total)
    n = math.floor(n / 2) * 2
    return n if 2 <= n <= total else 2


def _expected(duration: float, native_fps: float, width: int, height: int) -> tuple[int, int]:
    """Qwen2-VL's video rule written out: qwen_vl_utils' frame count of the clip's frames, each
    resized with smart_resize between 128 and 768 merged tokens."""
    frames = _qwen_nframes(round(duration * native_fps), native_fps)
    h, w = smart_resize(height, width, ImageConfig(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28))
    enc = frames // 2 * (h // 14) * (w // 14)
    return enc, enc // 4


@pytest.mark.parametrize("fmt, width, height, fps, frames", [
    ("mp4", 64, 48, 10, 25),     # 2.5 s -> 5 frames -> 4
    ("mp4", 160, 120, 4, 12),    # 3 s -> 6 frames
    ("mov", 96, 64, 8, 9),       # 1.125 s -> 2.25 frames, raised to the minimum 4
    ("mp4", 1280, 720, 1, 3),    # 1 fps: only 3 frames exist -> 2; 720p goes over max_pixels
    ("mkv", 128, 96, 5, 10),     # 2 s -> 4 frames
    ("webm", 80, 60, 6, 18),     # 3 s -> 6 frames
])
def test_header_counts_equal_the_formula(fmt, width, height, fps, frames):
    data = video_clip(width, height, fps, frames, seed=1, fmt=fmt)
    header = read_header(data)
    assert (header.width, header.height) == (width, height)
    assert header.duration_s == pytest.approx(frames / fps, abs=1e-3)
    assert header.fps == pytest.approx(fps, rel=1e-3)
    enc, llm, meta = count_video(data, VideoConfig())
    assert (enc, llm) == _expected(frames / fps, fps, width, height)
    assert (enc, llm) == video_lengths(header.duration_s, header.fps, width, height, VideoConfig())
    t, gh, gw = meta["grid_thw"]
    assert t * gh * gw == enc and llm * 4 == enc


def test_sampling_rules():
    cfg = VideoConfig()
    assert sampled_frames(0.1, 30, cfg) == 2  # 3 frames: the minimum 4 is more than the clip's pairs
    assert sampled_frames(2.4, 30, cfg) == 4  # 72 frames: 4.8 -> 4
    assert sampled_frames(3.0, 30, cfg) == 6
    assert sampled_frames(10.0, 0.5, cfg) == 4  # the clip holds only 5 frames: 4
    assert sampled_frames(3600.0, 30, cfg) == cfg.max_frames
    assert sampled_frames(3.0, 30, VideoConfig(fps=1.0)) == 4  # 3 frames, raised to the minimum
    assert sampled_frames(3.0, 30, VideoConfig(min_frames=7)) == 8  # 7 rounded up to pairs
    assert sampled_frames(3.0, 30, VideoConfig(min_frames=1)) == 6
    assert sampled_frames(1.0, 30, VideoConfig(min_frames=1)) == 2
    with pytest.raises(ValueError, match="fps=0"):
        VideoConfig(fps=0)
    with pytest.raises(ValueError, match="max_frames=7"):
        VideoConfig(max_frames=7)
    with pytest.raises(ValueError, match="min_frames=0"):
        VideoConfig(min_frames=0)
    with pytest.raises(ValueError, match="min_frames=800"):
        VideoConfig(min_frames=800)


@pytest.mark.parametrize("total, native_fps, ours_before, qwen", [
    (24, 25, 2, 4), (83, 25, 8, 6), (99, 30, 8, 6), (30, 10.714, 6, 4),
])
def test_frame_counts_are_qwen_vl_utils(total, native_fps, ours_before, qwen):
    """The tester's clips, whose counts differed from qwen_vl_utils' (`ours_before`): a dataset
    preprocessed with it gets the lengths planned."""
    assert _qwen_nframes(total, native_fps) == qwen != ours_before
    assert sampled_frames(total / native_fps, native_fps, VideoConfig()) == qwen
    # the picked indices spread over the whole clip, first and last frame included
    expected = [round(i * (total - 1) / (qwen - 1)) for i in range(qwen)]
    assert frame_indices(total / native_fps, native_fps, VideoConfig()).tolist() == expected


def test_qwen_rule_over_many_clips():
    """Counts and indices equal qwen_vl_utils' rule (written out here) over clip lengths and rates
    a header states, including min/max frames other than the defaults."""
    for native_fps in (1, 4, 10, 23.976, 24, 25, 29.97, 30, 60):
        for total in (1, 2, 3, 4, 5, 7, 9, 24, 50, 83, 99, 150, 301, 1800, 4001):
            for fps, least, most in ((2.0, 4, 768), (1.0, 4, 16), (0.5, 8, 768), (4.0, 1, 12)):
                cfg = VideoConfig(fps=fps, min_frames=least, max_frames=most)
                n = sampled_frames(total / native_fps, native_fps, cfg)
                assert n == _qwen_nframes(total, native_fps, fps, least, most), (total, native_fps, fps)
                got = frame_indices(total / native_fps, native_fps, cfg).tolist()
                if total == 1:
                    assert got == [0, 0]
                else:
                    assert got == [round(i * (total - 1) / (n - 1)) for i in range(n)]


def test_mp4_header_needs_no_decoder(monkeypatch):
    data, mkv = video_clip(64, 48, 10, 20, seed=2), video_clip(64, 48, 10, 20, seed=2, fmt="mkv")
    monkeypatch.setitem(sys.modules, "av", None)  # any `import av` now raises ImportError
    enc, _, meta = count_video(data, VideoConfig())
    assert enc > 0 and meta["codec"] == "avc1"
    with pytest.raises(CountError, match="need PyAV") as e:
        count_video(mkv, VideoConfig())
    assert e.value.reason == "video_unsupported"


def test_pyav_header_demuxes_and_decodes_no_frame(monkeypatch):
    """The WebM/MKV header is read from demuxed packets: a header read that decoded frames would
    cost as much as the trainer's decode (~19 ms against ~0.5 ms for this clip)."""
    data = video_clip(160, 120, 25, 250, seed=2, fmt="mkv")
    opened = []

    class NoDecode:
        def __init__(self, container):
            self._c = container

        def __getattr__(self, name):
            return getattr(self._c, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._c.__exit__(*exc)

        def decode(self, *args, **kwargs):
            raise AssertionError("the header read decoded frames")

    real_open = av.open

    def open_no_decode(*args, **kwargs):
        opened.append(args)
        return NoDecode(real_open(*args, **kwargs))

    monkeypatch.setattr(av, "open", open_no_decode)
    enc, _, meta = count_video(data, VideoConfig())
    assert opened, "the MKV header was not read through PyAV"
    assert enc > 0 and meta["frames"] == 250


def test_bad_clips_go_through_errors_skip_with_their_reason(tmp_path, capsys):
    good = video_clip(64, 48, 10, 20, seed=4)
    shard = tmp_path / "v.tar"
    shard.write_bytes(tar_bytes([
        ("a.mp4", good), ("a.txt", b"fine"),
        ("b.mp4", _half(good)), ("b.txt", b"cut"),
        ("c.mp4", mp4_with(delta=0)), ("c.txt", b"zero duration"),
        ("d.mkv", b"not a container at all"), ("d.txt", b"garbage"),
        ("e.mp4", good), ("e.txt", b"fine again"),
    ]))
    assert main(["inspect", "--json", "--errors", "skip", str(shard)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_samples"] == 2
    assert report["errors"]["by_reason"] == {"bad_video": 3}
    assert report["modalities"]["video"]["count"] == 2
    with pytest.raises(Exception, match="b.*MP4 box b'mdat'.*file cut"):
        list(iter_shard(str(shard), ReaderConfig(errors=ErrorPolicy(mode="raise"))))


def test_image_video_audio_text_sample_order_and_phases(tmp_path):
    clip_a, clip_b = video_clip(64, 48, 10, 10, seed=5), video_clip(96, 64, 10, 30, seed=6)
    shard = tmp_path / "mix.tar"
    shard.write_bytes(tar_bytes([  # tar order differs from the LLM order on purpose
        ("s.txt", b"caption"), ("s.wav", wav(1.0)), ("s.10.mp4", clip_b), ("s.2.mp4", clip_a),
        ("s.jpg", jpeg(40, 30)),
    ]))
    (rec,) = list(iter_shard(str(shard)))
    assert [(it.modality, it.member) for it in rec.items] == [
        ("image", "jpg"), ("video", "2.mp4"), ("video", "10.mp4"), ("audio", "wav")]
    assert [it.phase for it in rec.items] == ["vision", "vision", "vision", "audio"]
    assert MODALITY_PHASE["video"] == "vision"
    assert rec.items[1].enc_len == count_video(clip_a, VideoConfig())[0]
    assert rec.items[2].enc_len == count_video(clip_b, VideoConfig())[0]
    assert rec.llm_len == rec.text_len + sum(it.llm_len for it in rec.items)
    assert rec.modality_mix == "audio+image+video+text"


def test_video_options_change_counts(tmp_path, capsys):
    shard = tmp_path / "v.tar"
    shard.write_bytes(tar_bytes([("a.mp4", video_clip(640, 480, 10, 40, seed=7)), ("a.txt", b"t")]))
    assert main(["inspect", "--json", str(shard)]) == 0
    default = json.loads(capsys.readouterr().out)["modalities"]["video"]["enc_len"]["max"]
    assert main(["inspect", "--json", "--video-fps", "1", "--video-max-pixels", str(28 * 28 * 64), str(shard)]) == 0
    small = json.loads(capsys.readouterr().out)["modalities"]["video"]["enc_len"]["max"]
    # 4 s: 8 frames -> 4 frames; 640x480 within 64 merged tokens per frame
    assert small == _expected_at(4.0, 10, 1.0, 640, 480, 28 * 28 * 64) < default
    assert main(["inspect", "--json", "--video-fps", "1", "--video-min-frames", "6", "--video-max-pixels",
                 str(28 * 28 * 64), str(shard)]) == 0
    more = json.loads(capsys.readouterr().out)["modalities"]["video"]["enc_len"]["max"]
    assert more == small // 2 * 3  # 6 frames of the same size: 3 temporal patches for 2
    assert main(["inspect", "--video-fps", "0", str(shard)]) != 0
    assert "--video-fps 0.0" in capsys.readouterr().err


def _expected_at(duration: float, native_fps: float, fps: float, width: int, height: int, max_pixels: int) -> int:
    frames = _qwen_nframes(round(duration * native_fps), native_fps, fps)
    h, w = smart_resize(height, width, ImageConfig(min_pixels=min(128 * 28 * 28, max_pixels), max_pixels=max_pixels))
    return frames // 2 * (h // 14) * (w // 14)


@pytest.mark.parametrize("fmt, frames, fps", [("mp4", 25, 10), ("webm", 1, 4), ("mov", 7, 3)])
def test_video_patches_rows_equal_enc_len(fmt, frames, fps):
    data = video_clip(96, 64, fps, frames, seed=8, fmt=fmt)
    enc, _, meta = count_video(data, VideoConfig())
    x = video_patches(data, meta, enc_len=enc)
    assert x.dtype == np.float32 and x.shape == (enc, 3 * 2 * 14 * 14)
    assert np.isfinite(x).all()
    with pytest.raises(ValueError, match=f"enc_len={enc + 4}"):
        video_patches(data, meta, enc_len=enc + 4)
    with pytest.raises(ValueError, match="disagree"):
        video_patches(data, meta, VideoConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 4), enc_len=enc)


def _numbered_clip(num_frames: int, fps: int, fmt: str = "mp4", pts: list[int] | None = None) -> bytes:
    """A 64x64 H.264 clip whose frame i is one flat colour saying i: red (i // 16) and green
    (i % 16) in steps of 16, which the codec's error (a few levels) cannot blur into a neighbour.
    `pts` (in 1 / fps ticks) gives frame i its time: a variable frame rate."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=fps, options={"threads": "1"})
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        if pts is not None:
            stream.time_base = fractions.Fraction(1, fps)
        for i in range(num_frames):
            rgb = np.empty((64, 64, 3), np.uint8)
            rgb[...] = (16 * (i // 16) + 8, 16 * (i % 16) + 8, 128)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], fractions.Fraction(1, fps)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def _decoded_numbers(x: np.ndarray, frames: int) -> list[int]:
    """The frame numbers (`_numbered_clip`) of a 56x56 clip's patch rows, frame by frame."""
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    # rows (t, 2, 2, merge, merge) of 4x4 patches; features (channel, time, 14, 14)
    x = x.reshape(frames // 2, 16, 3, 2, 14 * 14).mean(axis=(1, 4))  # (t, channel, time)
    rgb = (x.transpose(0, 2, 1).reshape(frames, 3) * std + mean) * 255
    return [int(round((r - 8) / 16)) * 16 + int(round((g - 8) / 16)) for r, g, _ in rgb]


@pytest.mark.parametrize("total, fps, fmt", [(24, 25, "mp4"), (83, 25, "mp4"), (99, 30, "mov"), (61, 10, "mp4")])
def test_the_trainer_decodes_the_frames_qwen_vl_utils_picks(total, fps, fmt):
    """A real clip whose frames are numbered by colour: the patch rows hold the frames
    round(linspace(0, total - 1, n)) names, in order, n by qwen_vl_utils' count."""
    data = _numbered_clip(total, fps, fmt)
    cfg = VideoConfig(min_pixels=56 * 56, max_pixels=56 * 56)
    enc, _, meta = count_video(data, cfg)
    n = _qwen_nframes(total, fps)
    assert meta["grid_thw"] == [n // 2, 4, 4]
    x = video_patches(data, meta, cfg, enc_len=enc)
    assert x.shape[0] == enc == n // 2 * 16
    assert _decoded_numbers(x, n) == [round(i * (total - 1) / (n - 1)) for i in range(n)]


def test_a_one_frame_clip_is_one_temporal_patch_of_its_frame():
    """qwen_vl_utils refuses a clip of fewer frames than its factor; here it is one pair, the
    frame repeated, counted and decoded alike."""
    data = _numbered_clip(1, 25)
    cfg = VideoConfig(min_pixels=56 * 56, max_pixels=56 * 56)
    enc, llm, meta = count_video(data, cfg)
    assert meta["grid_thw"] == [1, 4, 4] and (enc, llm) == (16, 4)
    assert sampled_frames(meta["duration_s"], meta["fps"], cfg) == 2
    x = video_patches(data, meta, cfg, enc_len=enc)
    assert x.shape[0] == 16 and _decoded_numbers(x, 2) == [0, 0]


@pytest.mark.parametrize("min_frames", [4, 768])
def test_a_variable_rate_clip_counts_its_own_frames(min_frames):
    """10 H.264 frames with B-frames at uneven times (0 to 3.03 s): the total is the 10 the
    container holds, not its edit list's 3.067 s times the sample table's 8.571 fps (26, which
    repeated frames); qwen_vl_utils' count of them at FFmpeg's average rate, and the trainer's
    rows are those frames."""
    pts = [0, 1, 2, 10, 11, 30, 31, 32, 90, 91]
    data = _numbered_clip(len(pts), 30, pts=pts)
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        assert sum(1 for _ in c.decode(stream)) == 10
        rate = float(stream.average_rate)
    cfg = VideoConfig(min_pixels=56 * 56, max_pixels=56 * 56, min_frames=min_frames)
    enc, _, meta = count_video(data, cfg)
    assert read_header(data).frames == meta["frames"] == 10
    assert meta["fps"] == pytest.approx(rate)
    n = _qwen_nframes(10, rate, min_frames=min_frames)
    assert meta["grid_thw"] == [n // 2, 4, 4] and n == (4 if min_frames == 4 else 10)
    x = video_patches(data, meta, cfg, enc_len=enc)
    assert x.shape[0] == enc
    assert _decoded_numbers(x, n) == [round(i * 9 / (n - 1)) for i in range(n)]


def test_a_header_longer_than_its_frames_repeats_the_last_decoded_frame():
    """A header claiming 20 frames (2 s) more than the 20 decoded: the indices past them get the
    last frame, and the rows are still the count; so for an older data node's meta, which states
    no frame count (the total is then duration * fps)."""
    data = _numbered_clip(20, 10)
    cfg = VideoConfig(min_pixels=56 * 56, max_pixels=56 * 56)
    _, _, meta = count_video(data, cfg)
    assert meta["frames"] == 20
    longer = {**meta, "duration_s": 4.0, "frames": 40}  # 8 of them, indices 0, 6, 11, ..., 39
    older = {k: v for k, v in longer.items() if k != "frames"}
    n = _qwen_nframes(40, 10)
    picked = [min(19, round(i * 39 / (n - 1))) for i in range(n)]
    for claimed in (longer, older):
        x = video_patches(data, claimed, cfg, enc_len=n // 2 * 16)
        assert _decoded_numbers(x, n) == picked and picked[-1] == picked[-2] == 19


def test_video_patches_layout_is_qwen2_vl():
    """Row and feature order, checked element by element against the frames themselves."""
    data = video_clip(112, 84, 2, 4, seed=9)  # 2 s at 2 fps: 4 frames, resized to 112x84
    cfg = VideoConfig(min_pixels=112 * 84, max_pixels=112 * 84)
    _, _, meta = count_video(data, cfg)
    x = video_patches(data, meta, cfg)
    with av.open(io.BytesIO(data)) as c:
        frames = [f.reformat(width=112, height=84, format="rgb24", interpolation="BICUBIC").to_ndarray()
                  for f in c.decode(video=0)]
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    gt, gh, gw, m, p = 2, 84 // 14, 112 // 14, 2, 14
    rng = np.random.default_rng(0)
    for _ in range(50):
        t, bh, bw, ih, iw = (int(rng.integers(n)) for n in (gt, gh // m, gw // m, m, m))
        c, tt, py, px = (int(rng.integers(n)) for n in (3, 2, p, p))
        row = ((t * (gh // m) + bh) * (gw // m) + bw) * m * m + ih * m + iw
        col = ((c * 2 + tt) * p + py) * p + px
        pixel = frames[t * 2 + tt][(bh * m + ih) * p + py, (bw * m + iw) * p + px, c]
        assert x[row, col] == pytest.approx((pixel / 255 - mean[c]) / std[c], abs=1e-5)


def test_gen_data_shard_with_video_end_to_end(tmp_path):
    a = generate(str(tmp_path / "a"), num_samples=24, num_shards=2, seed=5, video_share=0.5)
    b = generate(str(tmp_path / "b"), num_samples=24, num_shards=2, seed=5, video_share=0.5)
    plain = generate(str(tmp_path / "c"), num_samples=24, num_shards=2, seed=5)
    assert [open(p, "rb").read() for p in a] == [open(p, "rb").read() for p in b]
    stats = ErrorStats()
    recs = list(iter_samples(a, ReaderConfig(), stats=stats))
    assert len(recs) == 24 and stats.num_errors == 0
    videos = [(r, it) for r in recs for it in r.items if it.modality == "video"]
    assert 4 <= len(videos) <= 20
    for r, it in videos:
        assert it.member == "mp4" and it.phase == "vision"
        assert 64 <= it.meta["width"] <= 160 and 1.0 <= it.meta["duration_s"] <= 3.0
        assert video_patches(r.members["mp4"], it.meta, enc_len=it.enc_len).shape[0] == it.enc_len
    # the other members of every sample are those of the shard without video
    without = {r.key: [i.member for i in r.items] for r in iter_samples(plain)}
    assert {r.key: [i.member for i in r.items if i.modality != "video"] for r in recs} == without


def test_video_items_travel_in_the_vision_phase_to_the_trainer(tmp_path):
    from tests.test_service import consume, dispatcher, make_config, readers

    shards = generate(str(tmp_path / "d"), num_samples=16, num_shards=2, seed=6, video_share=0.6)
    expected = {r.key: [(it.member, it.enc_len) for it in r.items if it.modality == "video"]
                for r in iter_samples(shards)}
    assert sum(map(len, expected.values())) >= 4

    def record(step):
        got = []
        for mb in step.microbatches:
            eb = mb.encoders.get("vision")
            if eb is None:
                continue
            for i, mod in enumerate(eb.modalities):
                if mod == "video":
                    rows = video_patches(eb.payloads[i], eb.meta[i], enc_len=int(eb.enc_len[i])).shape[0]
                    got.append((eb.sample_keys[i], eb.members[i], rows))
        return got

    with dispatcher(make_config(shards, world_size=2, global_batch=4)) as srv, readers(srv.reader_endpoint, 2):
        per_rank = consume(srv.trainer_endpoint, 2, record=record)
    got = sorted(v for steps in per_rank.values() for step in steps for v in step)
    assert got == sorted((k, m, n) for k, items in expected.items() for m, n in items)


def test_mutated_containers_count_or_raise_count_error():
    """Flipped, overwritten and cut bytes never crash the header parsers: a count or a CountError."""
    base = {fmt: video_clip(64, 48, 10, 12, seed=1, fmt=fmt) for fmt in ("mp4", "mkv")}
    rng = np.random.default_rng(0)
    outcomes = {"counted": 0, "refused": 0}
    for i in range(400):
        data = bytearray(base["mkv" if i % 5 == 0 else "mp4"])
        for _ in range(int(rng.integers(1, 4))):
            if len(data) < 8:
                break
            op = int(rng.integers(3))
            if op == 0:
                data[int(rng.integers(len(data)))] = int(rng.integers(256))
            elif op == 1:
                data = data[: int(rng.integers(1, len(data)))]
            else:
                j = int(rng.integers(len(data) - 4))
                data[j : j + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
        try:
            enc, llm, _ = count_video(bytes(data), VideoConfig())
        except CountError as e:
            assert e.reason in ("bad_video", "video_unsupported")
            outcomes["refused"] += 1
        else:
            assert enc > 0 and llm * 4 == enc
            outcomes["counted"] += 1
    assert outcomes["counted"] and outcomes["refused"]


def test_gen_data_cli_video_share(tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["gen-data", str(out), "--samples", "4", "--shards", "1", "--video-share", "1"]) == 0
    recs = list(iter_samples([str(out / "shard-000000.tar")]))
    assert [sum(it.modality == "video" for it in r.items) for r in recs] == [1, 1, 1, 1]
    assert main(["gen-data", str(tmp_path / "h"), "--video-share", "2"]) != 0
    assert "--video-share must be from 0 to 1" in capsys.readouterr().err
