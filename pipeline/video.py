"""Video: header-only counting (MP4/MOV hand-parsed, WebM/MKV through PyAV) and trainer-side patches.

Counting reads the container's tables, never a frame: MP4/MOV boxes (`moov/trak/mdhd/stsd/stts/
stsz`) are parsed here. Measured per clip: ~30 us, against 1-3 ms for PyAV's `av.open` (FFmpeg's
probe, which may decode a few frames) and 5-400 ms for a full decode; the parse needs no
dependency on data nodes and sees a cut `mdat` that the probe accepts. WebM/MKV (and fragmented
MP4) go through PyAV (the optional `[video]` extra), which also decodes frames for the trainer.
Frames are sampled at `VideoConfig.fps`, grouped in temporal patches of 2 and resized with the
image `smart_resize` rule, as Qwen2-VL does.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass

import numpy as np

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

    Frames are sampled at `fps` (2 per second), never more than the clip holds, rounded up to
    a multiple of `temporal_patch` (at least one temporal patch; the last frame repeats) and at
    most `max_frames` (768). Each frame is resized by `smart_resize` within [min_pixels,
    max_pixels] (Qwen2-VL's video budget: 128*28*28 to 768*28*28 per frame). Encoder length =
    (frames / temporal_patch) * (H / patch) * (W / patch), LLM length = that / merge^2.
    Headers outside `max_header_pixels`, `max_fps` or `max_duration_s` are corrupt, not video.
    """

    fps: float = 2.0
    temporal_patch: int = 2
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
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
        if self.max_frames < self.temporal_patch or self.max_frames % self.temporal_patch:
            raise ValueError(f"max_frames={self.max_frames} must be a positive multiple of "
                             f"temporal_patch={self.temporal_patch}")

    def image_rule(self) -> ImageConfig:
        """The per-frame resize rule as an `ImageConfig` (for `smart_resize`)."""
        return ImageConfig(patch_size=self.patch_size, merge_size=self.merge_size, min_pixels=self.min_pixels,
                           max_pixels=self.max_pixels, max_aspect_ratio=self.max_aspect_ratio)


@dataclass(frozen=True, slots=True)
class VideoHeader:
    """What a container header says about its first video track."""

    duration_s: float
    fps: float  # native frame rate
    width: int
    height: int
    codec: str
    container: str


def video_config(*, fps: float, max_pixels: int, patch_size: int, merge_size: int) -> VideoConfig:
    """The video rules the `--video-fps`/`--video-max-pixels` and patch options describe (data
    nodes and trainers build them here, so they cannot disagree): a budget under the default
    minimum lowers the minimum with it, so a budget under 1 is refused here, by its flag."""
    if max_pixels < 1:
        raise ValueError(f"--video-max-pixels must be >= 1 (pixels per sampled frame), got {max_pixels}")
    return VideoConfig(fps=fps, max_pixels=max_pixels, patch_size=patch_size, merge_size=merge_size,
                       min_pixels=min(VideoConfig().min_pixels, max_pixels))


# -- lengths -------------------------------------------------------------------------------------

def sampled_frames(duration_s: float, native_fps: float, cfg: VideoConfig) -> int:
    """Frames the model sees: ceil(duration * fps), capped by the clip's own frames and
    `max_frames`, rounded up to whole temporal patches (at least one)."""
    n = math.ceil(duration_s * cfg.fps - 1e-6)
    if native_fps > 0:
        n = min(n, max(1, math.ceil(duration_s * native_fps - 1e-6)))
    t = cfg.temporal_patch
    return min(cfg.max_frames, max(t, -(-n // t) * t))


def frame_size(width: int, height: int, cfg: VideoConfig) -> tuple[int, int]:
    """(height, width) every sampled frame is resized to."""
    try:
        return smart_resize(height, width, cfg.image_rule())
    except CountError as e:
        raise CountError("bad_video", str(e).replace("image", "video frame")) from None


def video_lengths(duration_s: float, fps: float, width: int, height: int, cfg: VideoConfig) -> tuple[int, int]:
    """(encoder patches, LLM tokens) of a clip of `duration_s` at native `fps`, `width`x`height`."""
    frames = sampled_frames(duration_s, fps, cfg)
    h, w = frame_size(width, height, cfg)
    enc = (frames // cfg.temporal_patch) * (h // cfg.patch_size) * (w // cfg.patch_size)
    return enc, enc // (cfg.merge_size * cfg.merge_size)


# -- MP4 / MOV ------------------------------------------------------------------------------------
def _bad(message: str) -> CountError:
    return CountError("bad_video", message)


def _boxes(data, start: int, end: int, *, strict: bool):
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
    if strict and pos < end and any(bytes(data[pos:end])):
        raise _bad(f"MP4 file ends with {end - pos} stray bytes after its last box")


def _child(data, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    for k, body, stop in _boxes(data, start, end, strict=False):
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


def mp4_header(data: bytes | memoryview) -> VideoHeader | None:
    """The first video track of an MP4/MOV file from its boxes; None if not ISO-BMFF or fragmented
    (fragments keep their tables in `moof` boxes; PyAV reads those).

    Besides the header, checks that the file is whole: every top-level box fits the bytes
    present, and the track's samples fit in `mdat` (a cut or lying file raises `bad_video`).
    """
    if len(data) < 8 or bytes(data[4:8]) not in _MP4_FIRST:
        return None
    top: dict[bytes, tuple[int, int]] = {}
    mdat_bytes = 0
    for kind, body, stop in _boxes(data, 0, len(data), strict=True):
        top.setdefault(kind, (body, stop))
        if kind == b"mdat":
            mdat_bytes += stop - body
    if b"moof" in top:
        return None
    if b"moov" not in top:
        raise _bad("MP4 has no moov box (cut before its index, or not an MP4)")
    for kind, body, stop in _boxes(data, *top[b"moov"], strict=False):
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
        # Duration as FFmpeg takes it: the sum of sample durations (mdhd's also counts the
        # B-frame reorder delay, one frame more with x264's defaults).
        (runs,) = struct.unpack_from(">I", data, stts[0] + 4) if stts[0] + 8 <= stts[1] else (None,)
        if runs is None or stts[0] + 8 + 8 * runs > stts[1]:
            raise _bad("MP4 stts box is shorter than it declares")
        table = np.frombuffer(data, ">u4", 2 * runs, stts[0] + 8).astype(np.int64).reshape(runs, 2)
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
        seconds = ticks / timescale
        fps = frames / seconds if seconds > 0 else 0.0
        brand = bytes(data[top[b"ftyp"][0] : top[b"ftyp"][0] + 4]) if b"ftyp" in top else b"qt  "
        return VideoHeader(seconds, fps, width, height, codec, "mov" if brand == b"qt  " else "mp4")
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


def _pyav_header(data: bytes | memoryview) -> VideoHeader:
    try:
        import av
    except ImportError:
        raise CountError("video_unsupported", "WebM/MKV and fragmented MP4 headers need PyAV: "
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
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / 1e6  # AV_TIME_BASE
            else:
                raise _bad(f"{container.format.name} container declares no duration")
            rate = stream.average_rate or stream.guessed_rate
            ctx = stream.codec_context
            return VideoHeader(duration, float(rate or 0.0), ctx.width, ctx.height, ctx.name,
                               container.format.name.split(",")[0])
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
        if bytes(data[:4]) != _EBML_MAGIC and bytes(data[4:8]) not in _MP4_FIRST:
            raise _bad("not an MP4, MOV, WebM or MKV container")
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
        raise _bad(f"video lasts {h.duration_s:.0f} s, over max_duration_s={cfg.max_duration_s}")
    if not (math.isfinite(h.fps) and 0 < h.fps <= cfg.max_fps):
        raise _bad(f"{h.container} declares {h.fps:g} frames per second, outside (0, {cfg.max_fps}]")
    if h.width < 1 or h.height < 1 or h.width * h.height > cfg.max_header_pixels:
        raise _bad(f"{h.container} declares {h.width}x{h.height} frames, outside [1, "
                   f"max_header_pixels={cfg.max_header_pixels}]")
    frames = sampled_frames(h.duration_s, h.fps, cfg)
    rows, cols = frame_size(h.width, h.height, cfg)
    enc = (frames // cfg.temporal_patch) * (rows // cfg.patch_size) * (cols // cfg.patch_size)
    meta = {"duration_s": h.duration_s, "fps": h.fps, "width": h.width, "height": h.height,
            "codec": h.codec, "format": h.container,
            "grid_thw": [frames // cfg.temporal_patch, rows // cfg.patch_size, cols // cfg.patch_size]}
    return enc, enc // (cfg.merge_size * cfg.merge_size), meta


# -- trainer side: decode, sample, resize, patchify ----------------------------------------------
def _sample_frames(data: bytes | memoryview, n_real: int, duration_s: float, rows: int, cols: int) -> list[np.ndarray]:
    """`n_real` RGB frames (rows x cols) shown at times i * duration / n_real, decoded in one pass."""
    import av

    targets = [i * duration_s / n_real for i in range(n_real)]
    picked: list[np.ndarray] = []
    t0 = None
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.video[0]
        step = 1.0 / float(stream.average_rate or stream.guessed_rate or 30)
        for frame in container.decode(stream):
            t = frame.time if frame.time is not None else len(picked) * step
            t0 = t if t0 is None else t0
            want = 0
            while len(picked) + want < n_real and targets[len(picked) + want] < t - t0 + step / 2:
                want += 1
            if want:
                rgb = frame.reformat(width=cols, height=rows, format="rgb24", interpolation="BICUBIC").to_ndarray()
                picked.extend([rgb] * want)
            if len(picked) == n_real:
                break
    if not picked:
        raise UndecodableError("video decodes to no frames")
    picked.extend([picked[-1]] * (n_real - len(picked)))  # a header longer than its frames
    return picked


def video_patches(data: bytes | memoryview, meta: dict, cfg: VideoConfig | None = None, *,
                  enc_len: int | None = None) -> np.ndarray:
    """Decode a clip into float32 patches of shape (enc_len, 3 * temporal_patch * patch^2).

    `meta` is the item's header facts as counted (`count_video`: duration_s, fps, width, height);
    frames are sampled, resized and padded exactly as counted, normalized with CLIP's mean/std
    and laid out as Qwen2-VL's processor does (rows ordered t, h/merge, w/merge, merge, merge;
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
        frames = sampled_frames(duration, fps, cfg)
        rows, cols = frame_size(int(width), int(height), cfg)
    except KeyError as e:
        raise ValueError(f"video meta lacks {e.args[0]!r}: pass the counted item's meta") from None
    except CountError as e:
        raise ValueError(str(e)) from None
    t, p, m = cfg.temporal_patch, cfg.patch_size, cfg.merge_size
    rows_out = (frames // t) * (rows // p) * (cols // p)
    if enc_len is not None and rows_out != enc_len:
        raise ValueError(f"video counts {rows_out} patches under this VideoConfig but enc_len={enc_len} "
                         f"was planned: data node and trainer disagree on the video settings")
    n_real = min(frames, max(1, math.ceil(duration * cfg.fps - 1e-6)))
    try:
        picked = _sample_frames(data, n_real, duration, rows, cols)
    except av.error.FFmpegError as e:  # a corrupt stream; some (InvalidDataError) are ValueErrors
        raise UndecodableError(f"video does not decode: {e}") from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever else a broken container makes PyAV raise
        raise UndecodableError(f"video does not decode: {e}") from None
    picked.extend([picked[-1]] * (frames - len(picked)))  # whole temporal patches
    x = (np.stack(picked).astype(np.float32) / 255.0 - _MEAN) / _STD  # (T, H, W, C)
    x = x.transpose(0, 3, 1, 2)  # (T, C, H, W)
    gt, gh, gw = frames // t, rows // p, cols // p
    x = x.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    out = np.ascontiguousarray(x).reshape(gt * gh * gw, 3 * t * p * p)
    if out.shape[0] != rows_out:  # an internal invariant, kept as a check for the trainer's sake
        raise ValueError(f"video gave {out.shape[0]} patch rows, expected {rows_out}")
    return out


__all__ = [
    "VideoConfig", "VideoHeader", "count_video", "frame_size", "mp4_header", "read_header", "sampled_frames",
    "video_lengths", "video_patches",
]
