"""Video: header-only counting (MP4/MOV hand-parsed, WebM/MKV/AVI through PyAV) and trainer-side patches.

Counting reads the container's tables, never a frame: MP4/MOV boxes (`moov/trak/mdhd/stsd/stts/
stsz`, and `elst`/`ctts` where an edit list says which samples are shown) are parsed here.
Measured per clip: 15-60 us, against 1-3 ms for PyAV's `av.open` (FFmpeg's probe, which may
decode a few frames) and 5-400 ms for a full decode; the parse needs no dependency on data nodes
and sees a cut `mdat` that the probe accepts. WebM/MKV, AVI (and fragmented MP4) go through PyAV
(the optional `[video]` extra), which also decodes frames for the trainer: their video stream's
packets are demuxed, not decoded, for its span. Either way the duration is the span FFmpeg
presents, so the frames sampled are real frames. Frames are counted and picked by
`qwen_vl_utils`' `smart_nframes` rule (at `VideoConfig.fps`, evenly spread over the clip), grouped
in temporal patches of 2 and resized with the image `smart_resize` rule within the clip's pixel
budget, as Qwen2-VL does.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass

import numpy as np

from pipeline import keepalive
from pipeline.counting import CountError, ImageConfig, UndecodableError, library_message, smart_resize

#: CLIP's normalization, which Qwen2-VL's image and video processors use.
_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"
_SEGMENT_ID = b"\x18\x53\x80\x67"
#: Box types an ISO-BMFF (MP4/MOV/3GP) file can start with.
_MP4_FIRST = frozenset([b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"styp", b"uuid"])


@dataclass(kw_only=True, slots=True)
class VideoConfig:
    """Frame sampling and resize policy for video; defaults are Qwen2-VL's (`qwen_vl_utils`).

    Frames are counted by `qwen_vl_utils`' `smart_nframes`: of a clip's `total` frames (the
    container's count: a variable frame rate keeps it from being duration * native fps), n =
    total / native_fps * `fps` (2 per second), raised to
    `min_frames` (4, rounded up to a multiple of `temporal_patch`), lowered to `max_frames` (768)
    and to `total` (rounded down to a multiple of `temporal_patch`), then rounded down to a
    multiple of `temporal_patch`. The frames taken are round(linspace(0, total - 1, n)): evenly
    spread over the whole clip, first and last included. A clip shorter than one temporal patch
    (which `qwen_vl_utils` refuses) is one temporal patch, its last frame repeated.
    Each frame is resized by `smart_resize` within [min_pixels, max_pixels] (Qwen2-VL's video
    budget: 128*28*28 to 768*28*28 per frame), and the whole clip within `total_pixels`
    (128000*28*28*0.9): a frame gets at most total_pixels / frames * temporal_patch, but never
    under min_pixels * 1.05 (qwen_vl_utils' rule; without it a 6-minute clip is 1.1 M encoder
    rows). Encoder length = (frames / temporal_patch) * (H / patch) * (W / patch), LLM length =
    that / merge^2.
    Headers outside `max_header_pixels`, `max_fps` or `max_duration_s` are corrupt, not video.
    """

    fps: float = 2.0
    temporal_patch: int = 2
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)
    min_frames: int = 4
    max_frames: int = 768
    max_aspect_ratio: float = 200.0
    max_header_pixels: int = 16384 * 16384  # HEVC's and AV1's largest level
    max_fps: float = 1000.0
    max_duration_s: float = 4 * 3600.0

    def __post_init__(self) -> None:
        if not self.fps > 0:
            raise ValueError(f"video fps={self.fps} must be > 0 (frames sampled per second of video)")
        if self.temporal_patch < 1 or self.patch_size < 1 or self.merge_size < 1:
            raise ValueError(f"temporal_patch={self.temporal_patch}, patch_size={self.patch_size} and "
                             f"merge_size={self.merge_size} must be >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < video min_pixels={self.min_pixels} <= max_pixels={self.max_pixels}")
        if self.total_pixels < 1:
            raise ValueError(f"video total_pixels={self.total_pixels} must be >= 1 (pixels of a whole clip)")
        if self.max_frames < self.temporal_patch or self.max_frames % self.temporal_patch:
            raise ValueError(f"max_frames={self.max_frames} must be a positive multiple of "
                             f"temporal_patch={self.temporal_patch}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"video min_frames={self.min_frames} must be from 1 to the most frames "
                             f"sampled of a clip ({self.max_frames})")

    def image_rule(self, frames: int) -> ImageConfig:
        """The resize rule of each of a clip's `frames` sampled frames as an `ImageConfig` (for
        `smart_resize`): its share of `total_pixels`, as `qwen_vl_utils.fetch_video` computes it."""
        share = max(min(self.max_pixels, self.total_pixels / frames * self.temporal_patch),
                    int(self.min_pixels * 1.05))
        return ImageConfig(patch_size=self.patch_size, merge_size=self.merge_size, min_pixels=self.min_pixels,
                           max_pixels=min(self.max_pixels, share), max_aspect_ratio=self.max_aspect_ratio)


@dataclass(frozen=True, slots=True)
class VideoHeader:
    """What a container header says about its first video track."""

    duration_s: float
    fps: float  # native frame rate
    frames: int  # frames the container presents: the clip's total (a variable rate makes it no duration * fps)
    width: int
    height: int
    codec: str
    container: str


def video_config(*, fps: float, min_frames: int, max_pixels: int, patch_size: int, merge_size: int,
                 max_duration_s: float = VideoConfig.max_duration_s) -> VideoConfig:
    """The video rules the `--video-fps`/`--video-min-frames`/`--video-max-pixels` and patch
    options describe (data nodes and trainers build them here, so they cannot disagree): a budget
    under the default minimum lowers the minimum with it, so a budget under one patch group (a
    token count given for pixels) is refused here, by its flag."""
    group = (patch_size * merge_size) ** 2  # the pixels of one LLM token
    if max_pixels < group:
        # A token budget given for a pixel one (Qwen's "768 (x 28 x 28)"): every frame resized
        # to one token, silently.
        raise ValueError(f"--video-max-pixels {max_pixels} is under one {patch_size * merge_size}x"
                         f"{patch_size * merge_size} patch group ({group} pixels): it counts "
                         f"pixels per sampled frame, e.g. {768 * group} (768 x {group})")
    return VideoConfig(fps=fps, min_frames=min_frames, max_pixels=max_pixels, patch_size=patch_size,
                       merge_size=merge_size, min_pixels=min(VideoConfig().min_pixels, max_pixels),
                       max_duration_s=max_duration_s)


# -- lengths -------------------------------------------------------------------------------------

def clip_frames(duration_s: float, native_fps: float, total: int | None = None) -> int:
    """Frames a clip holds: `total`, the container's own count, where the header gave it (an
    item meta without "frames", from an older data node: round(duration * native fps)), at least 1."""
    if not (math.isfinite(native_fps) and native_fps > 0):
        raise _bad(f"video declares {native_fps:g} frames per second: its frames cannot be counted")
    if total is not None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise _bad(f"video declares {total!r} frames: its frames cannot be counted")
        return total
    return max(1, round(duration_s * native_fps))


def sampled_frames(duration_s: float, native_fps: float, cfg: VideoConfig, total: int | None = None) -> int:
    """Frames the model sees, by `qwen_vl_utils`' `smart_nframes` (fps path) with
    `temporal_patch` as its factor: of the clip's `total` frames (`clip_frames`), total /
    native_fps * fps, at least `min_frames` rounded up to the factor, at most `max_frames` and
    `total` rounded down to it, and no more than `total`; then rounded down to the factor.
    Where `qwen_vl_utils` raises (a clip of fewer frames than one temporal patch: 1 frame at
    temporal patch 2), one temporal patch, its last frame repeated (`frame_indices`)."""
    t = cfg.temporal_patch
    total = clip_frames(duration_s, native_fps, total)
    least = -(-cfg.min_frames // t) * t
    most = min(cfg.max_frames, total) // t * t
    n = min(max(total / native_fps * cfg.fps, least), most, total)
    # A header's rate is frames / seconds, so total / native_fps * fps can come out 3.9999999999
    # where the clip's 2 s make 4: float noise must not drop a temporal patch.
    n = math.floor(n / t + 1e-9) * t
    return n if n >= t else t


def frame_indices(duration_s: float, native_fps: float, cfg: VideoConfig, total: int | None = None) -> np.ndarray:
    """Indices of the frames the model sees (`sampled_frames` of them), from the clip's first
    frame: round(linspace(0, total - 1, n)) over its `clip_frames`, as `qwen_vl_utils` picks them
    (it rounds a float32 `torch.linspace`, which, past ~10^4 frames, can pick a neighbour of the
    exact index: the count is the same). A clip shorter than one temporal patch repeats its last
    frame."""
    total = clip_frames(duration_s, native_fps, total)
    n = sampled_frames(duration_s, native_fps, cfg, total)
    if n > total:
        return np.minimum(np.arange(n), total - 1)
    return np.rint(np.linspace(0, total - 1, n)).astype(np.int64)


def frame_size(width: int, height: int, frames: int, cfg: VideoConfig) -> tuple[int, int]:
    """(height, width) each of a clip's `frames` sampled frames is resized to (counting and
    decoding both take it from here, so the clip's pixel budget cannot differ between them)."""
    try:
        return smart_resize(height, width, cfg.image_rule(frames))
    except CountError as e:
        raise CountError("bad_video", str(e).replace("image", "video frame")) from None


def video_lengths(duration_s: float, fps: float, width: int, height: int, cfg: VideoConfig,
                  total: int | None = None) -> tuple[int, int]:
    """(encoder patches, LLM tokens) of a clip of `duration_s` at native `fps`, `width`x`height`
    (of `total` frames, where known: see `clip_frames`)."""
    frames = sampled_frames(duration_s, fps, cfg, total)
    h, w = frame_size(width, height, frames, cfg)
    enc = (frames // cfg.temporal_patch) * (h // cfg.patch_size) * (w // cfg.patch_size)
    return enc, enc // (cfg.merge_size * cfg.merge_size)


# -- MP4 / MOV ------------------------------------------------------------------------------------
def _bad(message: str) -> CountError:
    return CountError("bad_video", message)


def _boxes(data, start: int, end: int):
    """(type, body start, box end) of each box in data[start:end]; a box running past `end` is a cut file."""
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        head = 8
        if size == 1:
            if pos + 16 > end:
                raise _bad(f"MP4 box {kind!r} at byte {pos} is cut inside its header")
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            head = 16
        elif size == 0:  # runs to the end of the enclosing space
            size = end - pos
        if size < head:
            raise _bad(f"MP4 box {kind!r} at byte {pos} declares {size} bytes, less than its header")
        if pos + size > end:
            raise _bad(f"MP4 box {kind!r} at byte {pos} declares {size} bytes but {end - pos} remain (file cut?)")
        yield kind, pos + head, pos + size
        pos += size


def _child(data, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    for k, body, stop in _boxes(data, start, end):
        if k == kind:
            return body, stop
    return None


def _times(data, body: int, stop: int, what: str) -> tuple[int, int]:
    """(timescale, duration) of an mvhd/mdhd full box (version 0 or 1)."""
    version = data[body]
    fmt, off = (">IQ", 20) if version == 1 else (">II", 12)
    if body + off + struct.calcsize(fmt) > stop:
        raise _bad(f"MP4 {what} box is too short")
    return struct.unpack_from(fmt, data, body + off)


def _runs(data, body: int, stop: int, what: str) -> np.ndarray:
    """The (count, value) runs of an stts or ctts full box as an (n, 2) int64 array."""
    (runs,) = struct.unpack_from(">I", data, body + 4) if body + 8 <= stop else (None,)
    if runs is None or body + 8 + 8 * runs > stop:
        raise _bad(f"MP4 {what} box is shorter than it declares")
    return np.frombuffer(data, ">u4", 2 * runs, body + 8).astype(np.int64).reshape(runs, 2)


def _media_span(data, stts: np.ndarray, ctts: tuple[int, int] | None) -> tuple[int, int]:
    """(first, end) presentation time of a track's samples in media ticks: decode times plus the
    `ctts` offsets (B-frames are shown after they are decoded; x264 delays every frame)."""
    counts, deltas = stts[:, 0], stts[:, 1]
    ticks = counts * deltas
    if ctts is None or not counts.any():
        return 0, int(ticks.sum())
    runs = _runs(data, *ctts, "ctts")
    offsets = np.append((runs[:, 1] ^ 0x80000000) - 0x80000000, 0)  # signed, as FFmpeg reads any version
    # Where both tables stay in one run a sample's time grows with its index: the first and
    # last samples of those stretches hold the extremes (no per-sample arrays).
    ends, off_ends = np.cumsum(counts), np.cumsum(runs[:, 0])
    cuts = np.sort(np.concatenate((ends, off_ends)))
    cuts = cuts[(cuts > 0) & (cuts < ends[-1])]
    i = np.concatenate(([0], cuts, cuts - 1, [ends[-1] - 1]))  # stretch firsts, then lasts
    r = np.searchsorted(ends, i, "right")
    shown = (np.cumsum(ticks) - ticks)[r] + (i - (ends - counts)[r]) * deltas[r]
    shown += offsets[np.searchsorted(off_ends, i, "right")]  # samples past the table: no offset
    half = len(i) // 2
    return int(shown[:half].min()), int((shown[half:] + deltas[r[half:]]).max())


def _shown_times(data, stts: np.ndarray, ctts: tuple[int, int] | None) -> np.ndarray:
    """Each sample's presentation time in media ticks: its decode time plus its `ctts` offset."""
    counts, deltas = stts[:, 0], stts[:, 1]
    shown = np.concatenate(([0], np.cumsum(np.repeat(deltas, counts))[:-1]))
    if ctts is not None:
        runs = _runs(data, *ctts, "ctts")
        # Runs past the samples are cut first: a lying count must not size an array.
        counts = np.diff(np.minimum(np.cumsum(runs[:, 0]), len(shown)), prepend=0)
        offsets = np.repeat((runs[:, 1] ^ 0x80000000) - 0x80000000, counts)
        shown[: len(offsets)] += offsets
    return shown


def _presented(data, elst: tuple[int, int], moov: tuple[int, int], stbl: tuple[int, int], stts: np.ndarray,
               timescale: int) -> tuple[float, int]:
    """(seconds, frames) an edit list presents, as FFmpeg plays it: each segment's duration (movie
    timescale, `mvhd`) from its media time, within the media's samples, and the samples shown in
    it; empty segments (a start delay) show no frame. A stream-copy trim (`ffmpeg -ss 3 -c copy`)
    keeps all the samples from the keyframe on and presents the rest only; x264's edit skips its
    B-frame delay."""
    mvhd = _child(data, *moov, b"mvhd")
    if mvhd is None:
        raise _bad("MP4 video track has an edit list but the file has no mvhd box")
    movie_scale, _ = _times(data, *mvhd, "mvhd")
    if movie_scale == 0:
        raise _bad("MP4 mvhd declares timescale 0")
    body, stop = elst
    if body + 8 > stop:
        raise _bad("MP4 elst box is too short")
    fmt = ">Qqi" if data[body] == 1 else ">Iii"  # segment duration, media time, rate
    (count,) = struct.unpack_from(">I", data, body + 4)
    if body + 8 + struct.calcsize(fmt) * count > stop:
        raise _bad("MP4 elst box is shorter than it declares")
    ctts = _child(data, *stbl, b"ctts")
    first, end = _media_span(data, stts, ctts)
    tick = timescale / movie_scale  # media ticks per movie tick
    seconds, spans = 0.0, []
    for duration, media_time, _ in struct.iter_unpack(fmt, data[body + 8 : body + 8 + struct.calcsize(fmt) * count]):
        if media_time < 0:  # an empty edit
            continue
        # A segment within one movie tick of the media's end reaches it (its duration is rounded).
        stop_at = media_time + duration * tick
        lo, hi = max(media_time, first), (end if stop_at >= end - tick else stop_at)
        seconds += max(0.0, hi - lo) / timescale
        spans.append((lo, hi))
    total = int(stts[:, 0].sum())
    if spans == [(first, end)]:  # x264's edit, or none cut: every sample (no per-sample arrays)
        return seconds, total
    shown = _shown_times(data, stts, ctts)
    return seconds, sum(int(np.count_nonzero((shown >= lo) & (shown < hi))) for lo, hi in spans)


#: Bytes of a track's last sample `_check_last_sample` looks at.
_LAST_SAMPLE_BYTES = 4096


def _check_last_sample(data, stbl: tuple[int, int], stsz: tuple[int, int], sample_size: int,
                       count: int) -> None:
    """`bad_video` where the track's last sample lies in zeros: a partial download that its
    downloader preallocated (aria2, BitTorrent clients) has every box whole, its index first (a
    "faststart" file, as web exports and phones write), and zeros where its later frames should
    be. Every codec's frame starts with bytes that are not all zero (a NAL length, a marker).
    The sample is found from the chunk offsets (stco/co64) and sample-to-chunk runs (stsc)."""
    co = _child(data, *stbl, b"stco")
    wide = co is None
    co = co or _child(data, *stbl, b"co64")
    stsc = _child(data, *stbl, b"stsc")
    if co is None or stsc is None or count == 0:
        return
    (chunks,) = struct.unpack_from(">I", data, co[0] + 4) if co[0] + 8 <= co[1] else (0,)
    (runs,) = struct.unpack_from(">I", data, stsc[0] + 4) if stsc[0] + 8 <= stsc[1] else (0,)
    width = 8 if wide else 4
    if (chunks == 0 or runs == 0 or co[0] + 8 + width * chunks > co[1]
            or stsc[0] + 8 + 12 * runs > stsc[1]):
        return  # FFmpeg reads no such table either: not this check's to judge
    last_chunk = struct.unpack_from(">Q" if wide else ">I", data, co[0] + 8 + width * (chunks - 1))[0]
    table = np.frombuffer(data, ">u4", 3 * runs, stsc[0] + 8).astype(np.int64).reshape(runs, 3)
    spans = np.diff(np.append(table[:, 0], chunks + 1))  # chunks each run covers
    before = int((spans * table[:, 1]).sum() - table[-1, 1])  # samples ahead of the last chunk
    if not 0 <= before < count:
        return
    if sample_size:
        sizes = np.full(count - before, sample_size, dtype=np.int64)
    else:
        sizes = np.frombuffer(data, ">u4", count - before, stsz[0] + 12 + 4 * before).astype(np.int64)
    at = last_chunk + int(sizes[:-1].sum())
    size = int(sizes[-1])
    if size and at + size <= len(data) and not any(data[at:at + min(size, _LAST_SAMPLE_BYTES)]):
        raise _bad(f"MP4 is truncated: zeros where its last frame should be (byte {at} of "
                   f"{len(data)}): a partial download, its index whole")


def mp4_header(data: bytes | memoryview) -> VideoHeader | None:
    """The first video track of an MP4/MOV file from its boxes; None if not ISO-BMFF or fragmented
    (fragments keep their tables in `moof` boxes; PyAV reads those).

    Besides the header, checks that the file is whole: every top-level box up to a whole moov and
    mdat fits the bytes present, and the track's samples fit in `mdat` (a cut or lying file raises
    `bad_video`). The duration is the span the track's edit list presents, as FFmpeg plays it,
    and the frames are the samples shown in it.
    """
    if len(data) < 8 or bytes(data[4:8]) not in _MP4_FIRST:
        return None
    top: dict[bytes, tuple[int, int]] = {}
    mdat_bytes = 0
    try:
        for kind, body, stop in _boxes(data, 0, len(data)):
            top.setdefault(kind, (body, stop))
            if kind == b"mdat":
                mdat_bytes += stop - body
    except CountError:
        # Bytes after a whole moov and mdat (appended metadata, padding) are not read by FFmpeg
        # either; a cut inside either box is (the samples must still fit in mdat, below).
        if b"moov" not in top or b"mdat" not in top:
            raise
    if b"moof" in top:
        return None
    if b"moov" not in top:
        raise _bad("MP4 has no moov box (cut before its index, or not an MP4)")
    for kind, body, stop in _boxes(data, *top[b"moov"]):
        if kind != b"trak":
            continue
        mdia = _child(data, body, stop, b"mdia")
        hdlr = mdia and _child(data, *mdia, b"hdlr")
        if hdlr is None or bytes(data[hdlr[0] + 8 : hdlr[0] + 12]) != b"vide":
            continue
        mdhd = _child(data, *mdia, b"mdhd")
        minf = _child(data, *mdia, b"minf")
        stbl = minf and _child(data, *minf, b"stbl")
        tables = {k: stbl and _child(data, *stbl, k) for k in (b"stsd", b"stts", b"stsz")}
        if mdhd is None or None in tables.values():
            raise _bad("MP4 video track lacks one of its mdhd, stsd, stts or stsz boxes")
        stsd, stts, stsz = tables.values()
        timescale, _ = _times(data, *mdhd, "mdhd")
        if timescale == 0:
            raise _bad("MP4 video track declares timescale 0")
        entry = stsd[0] + 8  # after version/flags and entry count: the first sample entry
        if entry + 36 > stsd[1]:
            raise _bad("MP4 video sample description is too short")
        codec = bytes(data[entry + 4 : entry + 8]).decode("latin-1")
        width, height = struct.unpack_from(">HH", data, entry + 32)
        table = _runs(data, *stts, "stts")
        frames, ticks = int(table[:, 0].sum()), int((table[:, 0] * table[:, 1]).sum())
        if stsz[0] + 12 > stsz[1]:
            raise _bad("MP4 stsz box is too short")
        sample_size, count = struct.unpack_from(">II", data, stsz[0] + 4)
        if count != frames:
            raise _bad(f"MP4 stts times {frames} frames but stsz sizes {count}")
        if sample_size:
            payload = sample_size * count
        else:
            if stsz[0] + 12 + 4 * count > stsz[1]:
                raise _bad(f"MP4 stsz declares {count} samples but holds fewer sizes")
            payload = int(np.frombuffer(data, ">u4", count, stsz[0] + 12).sum(dtype=np.int64))
        if payload > mdat_bytes:
            raise _bad(f"MP4 video samples total {payload} bytes but mdat holds {mdat_bytes} (file cut?)")
        _check_last_sample(data, stbl, stsz, sample_size, count)
        # The frame rate from the sample durations (mdhd's duration also counts x264's B-frame
        # delay), the duration from the edit list: what FFmpeg presents of those samples.
        seconds = ticks / timescale
        fps = frames / seconds if seconds > 0 else 0.0
        edts = _child(data, body, stop, b"edts")
        elst = edts and _child(data, *edts, b"elst")
        shown, presented = (_presented(data, elst, top[b"moov"], stbl, table, timescale) if elst and ticks
                            else (seconds, frames))
        brand = bytes(data[top[b"ftyp"][0] : top[b"ftyp"][0] + 4]) if b"ftyp" in top else b"qt  "
        return VideoHeader(shown, fps, presented, width, height, codec, "mov" if brand == b"qt  " else "mp4")
    raise _bad("MP4 has no video track")


# -- WebM / MKV (and fragmented MP4) through PyAV -------------------------------------------------
def _vint(data, pos: int) -> tuple[int, int, bool]:
    """(value, length, all-ones) of an EBML variable-size integer at `pos`."""
    first = data[pos]
    if first == 0:
        raise _bad("EBML size field longer than 8 bytes")
    length = 9 - first.bit_length()
    if pos + length > len(data):
        raise _bad("WebM/MKV header is cut")
    value = first & (0xFF >> length)
    for b in bytes(data[pos + 1 : pos + length]):
        value = (value << 8) | b
    return value, length, value == (1 << (7 * length)) - 1


def _ebml_problem(data) -> str | None:
    """Why a WebM/MKV file is visibly cut: its Segment declares more bytes than are present."""
    size, n, _ = _vint(data, 4)
    seg = 4 + n + size
    if seg + 4 > len(data) or bytes(data[seg : seg + 4]) != _SEGMENT_ID:
        return "no Segment after the EBML header"
    size, n, unknown = _vint(data, seg + 4)
    end = seg + 4 + n + size
    if not unknown and end > len(data):
        return f"Segment declares {end} bytes but the file holds {len(data)} (file cut?)"
    return None


def _stream_span(container, stream) -> tuple[float, int, int]:
    """(seconds, frames, end) of a video stream from its demuxed packets, none decoded: the first
    presented timestamp to the last frame's end, and the byte its last packet ends at (-1 where
    the demuxer does not say). Matroska keeps no per-stream duration, and its Duration (absent
    when muxed live) is the container's end: other streams and a start offset included."""
    rate = stream.average_rate or stream.guessed_rate
    step = round(1 / (rate * stream.time_base)) if rate else 0  # a packet stating no duration: a frame
    first = end = None
    frames = 0
    last_byte = -1
    for packet in container.demux(stream):
        t = packet.pts if packet.pts is not None else packet.dts
        if t is None or packet.is_discard:  # the demuxer's end-of-stream packet; frames FFmpeg drops
            continue
        frames += 1
        if not frames & keepalive.EVERY:  # hours of video: seconds of demuxing
            keepalive.alive()
        first = t if first is None else min(first, t)
        end = max(end if end is not None else t, t + (packet.duration or step))
        if packet.pos >= 0:
            last_byte = max(last_byte, packet.pos + packet.size)
    if not frames:
        raise _bad(f"{container.format.name.split(',')[0]} video stream holds no frame")
    return float((end - first) * stream.time_base), frames, last_byte


#: Zero bytes past a container's last video packet that make it a partial download: a muxer
#: ends its file with an index or a Void element (Matroska), an idx1 chunk (AVI), never a zero run.
_ZERO_TAIL_BYTES = 64


def _check_zero_tail(data, last_byte: int, seconds: float, declared: float | None, fps: float,
                     container: str) -> None:
    """`bad_video` where zeros follow the last demuxed frame to the file's end, and the frames
    fall short of the duration the container declares (or it declares none): a preallocated
    partial download of a WebM/MKV/AVI has a whole header and zeros where its later clusters
    should be. FFmpeg demuxes the frames before the zeros and stops without an error: the clip
    would be counted, and trained, as its first seconds. (Zeros over the index alone, every
    frame there, do no harm.)"""
    tail = len(data) - last_byte
    if last_byte < 0 or tail < _ZERO_TAIL_BYTES:
        return
    if declared and fps > 0 and seconds >= declared - 1.5 / fps:  # every frame there
        return
    head = bytes(data[last_byte:last_byte + min(tail, _LAST_SAMPLE_BYTES)])
    if not head.strip(b"\0") and not bytes(data[-_ZERO_TAIL_BYTES:]).strip(b"\0"):
        of = f" of {declared:.1f} s" if declared else ""
        raise _bad(f"{container} is truncated: zeros from byte {last_byte} of {len(data)}, after "
                   f"its frames of the first {seconds:.1f} s{of}: a partial download, its header whole")


def _native_fps(declared, seconds: float, frames: int) -> float:
    """A stream's frame rate: the one its container declares (FFmpeg's average rate, which
    `qwen_vl_utils` divides by) where it times the stream's frames, else frames / seconds.
    Matroska's millisecond timestamps make 18 frames at 6 fps span 2.999 s: 6.002 fps would
    count 5.998 frames at 2 fps where `qwen_vl_utils` counts 6."""
    if seconds <= 0:
        return 0.0
    rate = float(declared) if declared else 0.0
    return rate if math.isfinite(rate) and rate > 0 and round(seconds * rate) == frames else frames / seconds


def _pyav_header(data: bytes | memoryview) -> VideoHeader:
    try:
        import av
    except ImportError:
        raise CountError("video_unsupported", "WebM/MKV, AVI and fragmented MP4 headers need PyAV: "
                                              "pip install 'mmdispatch[video]'") from None
    if bytes(data[:4]) == _EBML_MAGIC:
        problem = _ebml_problem(data)
        if problem:
            raise _bad(f"WebM/MKV {problem}")
    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.video:
                raise _bad(f"{container.format.name} container has no video stream")
            stream = container.streams.video[0]
            ctx = stream.codec_context
            name = container.format.name.split(",")[0]
            seconds, frames, last_byte = _stream_span(container, stream)
            declared = container.duration / 1e6 if container.duration else None  # AV_TIME_BASE
            _check_zero_tail(data, last_byte, seconds, declared, frames / seconds if seconds > 0 else 0.0,
                             name)
            return VideoHeader(seconds, _native_fps(stream.average_rate, seconds, frames), frames, ctx.width,
                               ctx.height, ctx.name, name)
    except CountError:
        raise
    except Exception as e:  # FFmpeg reports every malformed input as some av.error.* / ValueError
        raise _bad(f"unreadable video container: {library_message(e)}") from None


def read_header(data: bytes | memoryview) -> VideoHeader:
    """The video header of a container, hand-parsed for MP4/MOV, through PyAV for the rest."""
    if len(data) < 8:
        raise _bad(f"{len(data)} bytes are no video container")
    header = mp4_header(data)
    if header is None:
        avi = bytes(data[:4]) == b"RIFF" and bytes(data[8:12]) == b"AVI "
        if not avi and bytes(data[:4]) != _EBML_MAGIC and bytes(data[4:8]) not in _MP4_FIRST:
            raise _bad("not an MP4, MOV, WebM, MKV or AVI container")
        header = _pyav_header(data)
    return header


def count_video(data: bytes | memoryview, cfg: VideoConfig) -> tuple[int, int, dict]:
    """(encoder length, LLM length, meta) of a video member from its header; `CountError` if it lies.

    `meta` carries the header facts and `grid_thw` (temporal patches, patch rows, patch columns),
    the grid a Qwen2-VL-style model needs for its position ids.
    """
    h = read_header(data)
    if not (math.isfinite(h.duration_s) and h.duration_s > 0):
        raise _bad(f"{h.container} declares duration {h.duration_s} s")
    if h.duration_s > cfg.max_duration_s:
        raise _bad(f"video lasts {h.duration_s:.0f} s, over the {cfg.max_duration_s:g} s limit "
                   f"(--max-clip-seconds; raise it for longer recordings)")
    if not (math.isfinite(h.fps) and 0 < h.fps <= cfg.max_fps):
        raise _bad(f"{h.container} declares {h.fps:g} frames per second, outside (0, {cfg.max_fps}]")
    if h.width < 1 or h.height < 1 or h.width * h.height > cfg.max_header_pixels:
        raise _bad(f"{h.container} declares {h.width}x{h.height} frames, outside [1, "
                   f"max_header_pixels={cfg.max_header_pixels}]")
    frames = sampled_frames(h.duration_s, h.fps, cfg, h.frames)
    rows, cols = frame_size(h.width, h.height, frames, cfg)
    enc = (frames // cfg.temporal_patch) * (rows // cfg.patch_size) * (cols // cfg.patch_size)
    meta = {"duration_s": h.duration_s, "fps": h.fps, "frames": h.frames, "width": h.width, "height": h.height,
            "codec": h.codec, "format": h.container,
            "grid_thw": [frames // cfg.temporal_patch, rows // cfg.patch_size, cols // cfg.patch_size]}
    return enc, enc // (cfg.merge_size * cfg.merge_size), meta


# -- trainer side: decode, sample, resize, patchify ----------------------------------------------
def _sample_frames(data: bytes | memoryview, indices: np.ndarray, native_fps: float, rows: int,
                   cols: int, *, by_index: bool) -> list[np.ndarray]:
    """The RGB frames (rows x cols) at `indices` (non-decreasing, from the clip's first frame),
    decoded in one pass: index i is the i-th frame decoded where `by_index` (the total is the
    container's frame count, as `qwen_vl_utils` indexes its decoded frames; a variable rate puts
    frame i anywhere), else the frame shown at i / native_fps after the first (an older meta's
    total, round(duration * fps))."""
    import av

    step = 1.0 / native_fps
    targets = indices * step
    picked: list[np.ndarray] = []
    t0 = last = None
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.video[0]
        for k, frame in enumerate(container.decode(stream)):
            last = frame
            t = k * step if by_index or frame.time is None else frame.time
            t0 = t if t0 is None else t0
            want = 0
            # The frame nearest each target: a clip's timestamps are rounded to its timescale.
            while len(picked) + want < len(targets) and targets[len(picked) + want] < t - t0 + step / 2:
                want += 1
            if want:
                rgb = frame.reformat(width=cols, height=rows, format="rgb24", interpolation="BICUBIC").to_ndarray()
                picked.extend([rgb] * want)
            if len(picked) == len(targets):
                break
        if last is None:
            raise UndecodableError("video decodes to no frames")
        if len(picked) < len(targets):  # a header longer than its frames: the last one shown
            rgb = last.reformat(width=cols, height=rows, format="rgb24", interpolation="BICUBIC").to_ndarray()
            picked.extend([rgb] * (len(targets) - len(picked)))
    return picked


def video_patches(data: bytes | memoryview, meta: dict, cfg: VideoConfig | None = None, *,
                  enc_len: int | None = None) -> np.ndarray:
    """Decode a clip into float32 patches of shape (enc_len, 3 * temporal_patch * patch^2).

    `meta` is the item's header facts as counted (`count_video`: duration_s, fps, frames, width,
    height; frames may be absent);
    the frames `frame_indices` names are decoded, resized exactly as counted, normalized with
    CLIP's mean/std and laid out as Qwen2-VL's processor does (rows ordered t, h/merge, w/merge, merge, merge;
    features ordered channel, time, patch row, patch column). Raises ValueError when the rows
    would differ from `enc_len` (the planned length) or the clip does not decode.
    """
    try:
        import av  # noqa: F401  (decoding happens in _sample_frames; its errors are caught below)
    except ImportError:
        raise ImportError("video_patches decodes with PyAV: pip install 'mmdispatch[video]'") from None
    cfg = cfg or VideoConfig()
    try:
        duration, fps, width, height = (meta[k] for k in ("duration_s", "fps", "width", "height"))
        total = meta.get("frames")  # absent from an older data node's meta: round(duration * fps)
        indices = frame_indices(duration, fps, cfg, total)
        frames = len(indices)
        rows, cols = frame_size(int(width), int(height), frames, cfg)
    except KeyError as e:
        raise ValueError(f"video meta lacks {e.args[0]!r}: pass the counted item's meta") from None
    except CountError as e:
        raise ValueError(str(e)) from None
    t, p, m = cfg.temporal_patch, cfg.patch_size, cfg.merge_size
    rows_out = (frames // t) * (rows // p) * (cols // p)
    if enc_len is not None and rows_out != enc_len:
        raise ValueError(f"video counts {rows_out} patches under this VideoConfig but enc_len={enc_len} "
                         f"was planned: data node and trainer disagree on the video settings")
    try:
        picked = _sample_frames(data, indices, fps, rows, cols, by_index=total is not None)
    except av.error.FFmpegError as e:  # a corrupt stream; some (InvalidDataError) are ValueErrors
        raise UndecodableError(f"video does not decode: {e}") from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever else a broken container makes PyAV raise
        raise UndecodableError(f"video does not decode: {e}") from None
    x = (np.stack(picked).astype(np.float32) / 255.0 - _MEAN) / _STD  # (T, H, W, C)
    x = x.transpose(0, 3, 1, 2)  # (T, C, H, W)
    gt, gh, gw = frames // t, rows // p, cols // p
    x = x.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    out = np.ascontiguousarray(x).reshape(gt * gh * gw, 3 * t * p * p)
    if out.shape[0] != rows_out:  # an internal invariant, kept as a check for the trainer's sake
        raise ValueError(f"video gave {out.shape[0]} patch rows, expected {rows_out}")
    return out


__all__ = [
    "VideoConfig", "VideoHeader", "clip_frames", "count_video", "frame_indices", "frame_size", "mp4_header",
    "read_header", "sampled_frames", "video_lengths", "video_patches",
]
