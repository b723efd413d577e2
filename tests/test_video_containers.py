"""Containers whose header states another span than FFmpeg presents: each is counted as PyAV
decodes it (an MP4 edit list, a WebM/MKV stream beside longer audio or starting late, a WebM
muxed live with no Duration, an AVI), the model sees real frames rather than copies of the last,
bytes after a whole MP4 are ignored as FFmpeg ignores them, and long clips share a pixel budget."""

from __future__ import annotations

import io
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from pipeline.counting import CountError, ImageConfig, smart_resize
from pipeline.gendata import video_clip
from pipeline.video import VideoConfig, count_video, read_header, video_lengths, video_patches
from tests.badcorpus import _half

av = pytest.importorskip("av")
pytestmark = pytest.mark.timeout(120)

CFG = VideoConfig()


class _Pipe(io.RawIOBase):
    """A write-only stream that cannot seek: what a browser's MediaRecorder or a live muxer writes to."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.data += bytes(b)
        return len(b)


def _clip(fmt: str, codec: str, seconds: float, *, fps: int = 25, audio_s: float = 0.0, start_s: float = 0.0,
          options: dict | None = None, out=None) -> bytes:
    """`seconds` of `codec` video (distinct frames) in a `fmt` container, with `audio_s` of silent
    audio beside it and timestamps from `start_s` on; `out` may be a file name or a `_Pipe`."""
    target = io.BytesIO() if out is None else out
    with av.open(target, "w", format=fmt) as container:
        video = container.add_stream(codec, rate=fps, options={"threads": "1", **(options or {})})
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("libopus" if fmt == "webm" else "aac", rate=48000) if audio_s else None
        ramp = np.add.outer(np.arange(48), np.arange(64))[..., None]
        for i in range(round(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(((ramp * 2 + 8 * i) % 256).astype(np.uint8).repeat(3, 2),
                                               format="rgb24")
            frame.pts = i + round(start_s * fps)
            container.mux(video.encode(frame))
        container.mux(video.encode())
        if audio:
            step = audio.codec_context.frame_size or 1024
            for j in range(math.ceil(audio_s * 48000 / step)):
                chunk = av.AudioFrame.from_ndarray(np.zeros((1, step), np.float32), format="fltp", layout="mono")
                chunk.sample_rate, chunk.pts = 48000, j * step
                container.mux(audio.encode(chunk))
            container.mux(audio.encode())
    if isinstance(target, _Pipe):
        return bytes(target.data)
    return target.getvalue() if out is None else Path(out).read_bytes()


def _remux(data: bytes, fmt: str, *, shift_s: float = 0.0, options: dict | None = None, out=None) -> bytes:
    """The video stream of `data` copied into `fmt` with every timestamp moved back `shift_s`:
    what `ffmpeg -ss 3 -c copy` writes (all packets from the keyframe on, an edit list presenting the rest)."""
    target = io.BytesIO() if out is None else out
    with av.open(io.BytesIO(data)) as src, av.open(target, "w", format=fmt, options=options or {}) as dst:
        stream = src.streams.video[0]
        copy = dst.add_stream_from_template(stream)
        shift = round(shift_s / stream.time_base)
        for packet in src.demux(stream):
            if packet.dts is None:
                continue
            packet.pts, packet.dts, packet.stream = packet.pts - shift, packet.dts - shift, copy
            dst.mux(packet)
    return target.getvalue() if out is None else Path(out).read_bytes()


def _decoded_s(data: bytes) -> float:
    """Seconds of video PyAV decodes (every clip here has a constant frame rate)."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        return sum(1 for _ in c.decode(stream)) / float(stream.average_rate or stream.guessed_rate)


def _frames_seen(data: bytes, cfg: VideoConfig = CFG) -> tuple[int, int]:
    """(distinct frames in the model input, frames sampled from the clip), the trainer's patches
    laid back out as frames; asserts they are the rows planned."""
    enc, _, meta = count_video(data, cfg)
    out = video_patches(data, meta, cfg, enc_len=enc)
    gt, gh, gw = meta["grid_thw"]
    t, p, m = cfg.temporal_patch, cfg.patch_size, cfg.merge_size
    frames = out.reshape(gt, gh // m, gw // m, m, m, 3, t, p, p).transpose(0, 6, 5, 1, 3, 7, 2, 4, 8)
    frames = frames.reshape(gt * t, -1)
    sampled = min(gt * t, max(1, round(meta["duration_s"] * meta["fps"])))  # the clip's own frames
    return len(np.unique(frames[:sampled], axis=0)), sampled


def _counted_as_decoded(data: bytes, seconds: float) -> None:
    assert _decoded_s(data) == pytest.approx(seconds, abs=1e-3)
    assert read_header(data).duration_s == pytest.approx(seconds, abs=1e-3)
    with av.open(io.BytesIO(data)) as c:
        assert read_header(data).frames == sum(1 for _ in c.decode(c.streams.video[0]))
    distinct, sampled = _frames_seen(data)
    assert distinct == sampled  # no padding copies of the last frame


# -- MP4/MOV edit lists ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mp4", "mov"])
def test_a_stream_copy_trim_counts_what_its_edit_list_presents(fmt):
    """4 s of H.264 trimmed by 3 s without re-encoding keeps every sample (the keyframe is at
    0 s) and an edit list presenting the last second: counted 4 s before, and the model got 2
    distinct frames of 8."""
    trimmed = _remux(video_clip(64, 48, 25, 100, seed=1), fmt, shift_s=3.0)
    _counted_as_decoded(trimmed, 1.0)
    # 25 frames shown: 25 / 25 * 2 = 2 frames, raised to qwen_vl_utils' minimum of 4: 2 pairs.
    assert count_video(trimmed, CFG)[2]["grid_thw"][0] == 2


def _edited(duration: int | None = None, media_time: int | None = None) -> bytes:
    """A 4 s B-frame clip (edit: 4000 movie ticks from media time 1024) with its edit rewritten."""
    data = bytearray(video_clip(64, 48, 25, 100, seed=1))
    at = data.index(b"elst") + 4 + 8  # after version/flags and entry count
    assert struct.unpack_from(">Ii", data, at) == (4000, 1024)
    struct.pack_into(">Ii", data, at, 4000 if duration is None else duration,
                     1024 if media_time is None else media_time)
    return bytes(data)


@pytest.mark.parametrize(("edit", "seconds"), [
    ({"duration": 3999}, 4.0),  # rounded down to the movie timescale: every frame still shows
    ({"duration": 9000}, 4.0),  # past the media: what the media holds
    ({"media_time": 0}, 3.92),  # from before x264's 2-frame delay: 2 frames fall outside
    ({"duration": 2000, "media_time": 12800 + 1024}, 2.0),  # 1 s in, for 2 s
])
def test_an_edit_list_is_counted_as_ffmpeg_plays_it(edit, seconds):
    _counted_as_decoded(_edited(**edit), seconds)


def test_an_empty_edit_presents_no_frame_and_is_refused():
    clip = _edited(media_time=-1)
    assert _decoded_s(clip) == 0
    with pytest.raises(CountError, match="declares duration 0"):
        count_video(clip, CFG)


def _ordinary(tmp_path) -> dict[str, tuple[bytes, int, int]]:
    """Ordinary files (name -> data, frames, fps): their edit list only skips the B-frame delay."""
    faststart = str(tmp_path / "fast.mp4")
    return {
        "x264 B-frames": (video_clip(64, 48, 25, 50, seed=2), 50, 25),
        "no B-frames": (_clip("mp4", "libx264", 2.0, options={"bf": "0"}), 50, 25),
        "mpeg4": (_clip("mp4", "mpeg4", 2.0), 50, 25),
        "mov": (video_clip(96, 64, 8, 9, seed=3, fmt="mov"), 9, 8),
        "30 fps, 1.667 s": (video_clip(64, 48, 30, 50, seed=4), 50, 30),
        "faststart": (_remux(video_clip(64, 48, 10, 25, seed=5), "mp4", options={"movflags": "+faststart"},
                             out=faststart), 25, 10),
    }


def test_ordinary_mp4_and_mov_count_as_before(tmp_path):
    """Before the edit list was read the count was the sum of sample durations: it still is."""
    for name, (data, frames, fps) in _ordinary(tmp_path).items():
        assert b"elst" in data, name
        header = read_header(data)
        assert header.duration_s == pytest.approx(frames / fps, abs=1e-9), name
        assert header.duration_s == pytest.approx(_decoded_s(data), abs=1e-9), name
        assert count_video(data, CFG)[0] == video_lengths(frames / fps, fps, header.width, header.height, CFG)[0]


# -- WebM / MKV: the video stream's span ----------------------------------------------------------
@pytest.mark.parametrize(("fmt", "codec", "audio_s", "start_s"), [
    ("webm", "libvpx-vp9", 20.0, 0.0),  # 1 s of VP9 beside 20 s of Opus: counted 20 s before
    ("matroska", "libx264", 20.0, 0.0),  # H.264 beside AAC
    ("matroska", "libx264", 0.0, 10.0),  # timestamps from 10 s (-copyts): counted 11 s before
])
def test_a_matroska_video_stream_counts_its_own_span(fmt, codec, audio_s, start_s):
    data = _clip(fmt, codec, 1.0, audio_s=audio_s, start_s=start_s)
    _counted_as_decoded(data, 1.0)


def test_the_same_stream_counts_the_same_in_any_container():
    mkv = _clip("matroska", "libx264", 2.0, audio_s=5.0, start_s=3.0)
    counts = {fmt: count_video(_remux(mkv, fmt), CFG)[0] for fmt in ("mp4", "mov", "matroska")}
    assert counts == {fmt: count_video(mkv, CFG)[0] for fmt in counts}


def test_a_webm_muxed_live_without_a_duration_counts_from_its_packets():
    """MediaRecorder and live muxers never go back to write the Duration: refused before
    ("declares no duration") though every frame decodes."""
    data = _clip("webm", "libvpx-vp9", 1.0, out=_Pipe())
    with av.open(io.BytesIO(data)) as c:
        assert c.duration is None
    _counted_as_decoded(data, 1.0)


# -- bytes after the last MP4 box -----------------------------------------------------------------
@pytest.mark.parametrize("tail", [b"\x01\x02\x03", b"some appended metadata\n" * 4, bytes(4096)])
@pytest.mark.parametrize("faststart", [False, True])
def test_bytes_after_a_whole_mp4_are_ignored_as_ffmpeg_ignores_them(tmp_path, tail, faststart):
    """Refused before: "ends with 3 stray bytes", or the text read as a box of 1936682341 bytes."""
    data = video_clip(64, 48, 10, 20, seed=6)
    if faststart:
        data = _remux(data, "mp4", options={"movflags": "+faststart"}, out=str(tmp_path / "f.mp4"))
    assert count_video(data + tail, CFG) == count_video(data, CFG)
    _counted_as_decoded(data + tail, 2.0)


def test_an_mp4_cut_inside_moov_or_mdat_is_still_refused(tmp_path):
    data = video_clip(64, 48, 10, 20, seed=6)  # mdat, then moov
    fast = _remux(data, "mp4", options={"movflags": "+faststart"}, out=str(tmp_path / "f.mp4"))
    for cut in (data[:-10], _half(data), fast[:-10], fast[: fast.index(b"mdat") + 20]):
        with pytest.raises(CountError, match="file cut"):
            count_video(cut + b"\x01\x02\x03", CFG)


# -- AVI ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("codec", "options"), [("mpeg4", {}), ("mpeg4", {"bf": "2"}), ("libx264", {})])
def test_an_avi_is_counted_through_pyav(codec, options):
    """`serve` suggests `--map video=avi`; such members were refused ("not an MP4, MOV, WebM or MKV")."""
    data = _clip("avi", codec, 2.0, options=options)
    assert read_header(data).container == "avi"
    _counted_as_decoded(data, 2.0)


def test_an_avi_member_is_video_by_default(tmp_path):
    """UCF101 and HMDB51 ship .avi: counted as video without a field map."""
    from pipeline.reader import iter_samples
    from tests.servicekit import tar_of

    shard = tar_of(str(tmp_path / "avi.tar"), [("k", {"avi": _clip("avi", "mpeg4", 1.0), "txt": b"a jump"})])
    (rec,) = iter_samples([shard])
    assert [(it.modality, it.member) for it in rec.items] == [("video", "avi")]


def test_an_unknown_container_is_refused_naming_those_counted():
    with pytest.raises(CountError, match=r"^not an MP4, MOV, WebM, MKV or AVI container$"):
        count_video(b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(64), CFG)


# -- the clip's pixel budget ----------------------------------------------------------------------
def test_a_long_clip_shares_qwen_vl_utils_total_pixel_budget():
    """6 minutes of 1080p: 720 frames of 768*28*28 pixels were 1.04 M encoder rows (11 GB of
    float32 to decode); qwen_vl_utils gives each frame its share of 128000*28*28*0.9 pixels."""
    assert CFG.total_pixels == int(128000 * 28 * 28 * 0.9)
    frames = 720
    budget = max(min(768 * 28 * 28, CFG.total_pixels / frames * 2), int(128 * 28 * 28 * 1.05))
    h, w = smart_resize(1080, 1920, ImageConfig(min_pixels=128 * 28 * 28, max_pixels=budget))
    enc, llm = video_lengths(360.0, 30.0, 1920, 1080, CFG)
    assert enc == frames // 2 * (h // 14) * (w // 14) and llm == enc // 4
    assert enc < 450_000
    assert video_lengths(3.0, 30.0, 1920, 1080, CFG) == video_lengths(
        3.0, 30.0, 1920, 1080, VideoConfig(total_pixels=10**12))  # a short clip is within it


def test_the_pixel_budget_sizes_the_count_and_the_decode_alike():
    data = video_clip(160, 120, 10, 20, seed=7)
    loose = VideoConfig(min_pixels=28 * 28, max_pixels=64 * 28 * 28)
    tight = VideoConfig(min_pixels=28 * 28, max_pixels=64 * 28 * 28, total_pixels=4 * 28 * 28)
    assert count_video(data, loose)[2]["grid_thw"] == [2, 8, 12]
    enc, _, meta = count_video(data, tight)
    assert meta["grid_thw"] == [2, 2, 2]  # each of 4 frames gets 2*28*28 pixels: 28x28
    assert video_patches(data, meta, tight, enc_len=enc).shape == (enc, 3 * 2 * 14 * 14)
    with pytest.raises(ValueError, match="total_pixels=0"):
        VideoConfig(total_pixels=0)


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
@pytest.mark.parametrize("kept", [0.3, 0.6, 0.9])
def test_a_preallocated_partial_faststart_mp4_is_refused(tmp_path, codec, kept):
    """A "faststart" MP4 (its index first, as web exports and phones write) that a preallocating
    downloader left half done: every box is whole and the zeros lie where the later frames
    should be. It was counted whole and could not be decoded on the trainer (a blank input)."""
    with av.open(str(tmp_path / "clip.mp4"), "w", format="mp4", options={"movflags": "faststart"}) as out:
        video = out.add_stream(codec, rate=25, options={"threads": "1"})
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        noise = np.random.default_rng(0)  # frames that compress badly: mdat outweighs the index
        for _ in range(50):
            frame = noise.integers(0, 256, (48, 64, 3), dtype=np.uint8)
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())
    whole = (tmp_path / "clip.mp4").read_bytes()
    assert whole.find(b"moov") < whole.find(b"mdat")
    enc, _, _ = count_video(whole, CFG)  # the whole file counts
    assert enc > 0
    cut = int(len(whole) * kept)
    assert whole.find(b"mdat") < 0.3 * len(whole)
    with pytest.raises(CountError, match="MP4 is truncated: zeros where its last frame should be") as err:
        count_video(whole[:cut] + bytes(len(whole) - cut), CFG)
    assert err.value.reason == "bad_video"


@pytest.mark.parametrize("fmt", ["mkv", "webm"])
@pytest.mark.parametrize("kept", [0.1, 0.4, 0.7])
def test_a_preallocated_partial_matroska_is_refused(fmt, kept):
    """A WebM/MKV that a preallocating downloader left part done: its header whole, zeros where
    its later clusters should be. FFmpeg demuxes the frames before the zeros without an error,
    so the clip was counted as its first seconds and trained so (or undecodable on the trainer)."""
    whole = video_clip(64, 48, 10, 100, seed=1, fmt=fmt)
    assert count_video(whole, CFG)[2]["frames"] == 100
    cut = int(len(whole) * kept)
    with pytest.raises(CountError, match=r"matroska is truncated: zeros from byte \d+ of \d+, after its "
                                         r"frames of the first [\d.]+ s of 10.0 s") as err:
        count_video(whole[:cut] + bytes(len(whole) - cut), CFG)
    assert err.value.reason == "bad_video"


def test_a_matroska_whose_index_alone_is_zeros_counts_every_frame():
    """Zeros over what follows the last frame (the Cues index) lose no frame: counted whole."""
    whole = video_clip(64, 48, 25, 600, seed=1, fmt="mkv")  # its Cues outgrow the zero run that counts
    with av.open(io.BytesIO(whole)) as c:
        end = max(p.pos + p.size for p in c.demux(c.streams.video[0]) if p.pts is not None)
    assert len(whole) - end >= 64
    enc, _, meta = count_video(whole[:end] + bytes(len(whole) - end), CFG)
    assert (enc, meta["frames"]) == (count_video(whole, CFG)[0], 600)
