"""Model inputs from member bytes, exactly the planned length: image patches and audio log-mels.

numpy, Pillow, soundfile and scipy only (no torch), so a trainer's prefetch pool and a data node
(`mmdispatch read --preprocess-on datanode`) run the very same code and produce the same arrays.
Every result has exactly one row per encoder position the data node counted (`enc_len`), and
`preprocess_item` checks that against the plan before anything reaches a model.

Images (Qwen2-VL's image processor): decoded and converted to RGB with Pillow (16-bit grayscale
scaled to 8 bits first, where Pillow would clip it), resized with
BICUBIC to the `(h_bar, w_bar)` that `pipeline.counting.smart_resize` gives for the image's size
under the same `ImageConfig` the data node counted with, scaled to [0, 1] and normalized with the
OpenAI CLIP mean/std. Then patchified in Qwen2-VL's layout: the frame is repeated for the
temporal patch of 2, rows are the (H/14)*(W/14) patches ordered so that each merge x merge group
of neighbouring patches is contiguous (rows 4k..4k+3 become LLM token k with merge 2), and a row
holds channel x temporal x patch_h x patch_w = 3*2*14*14 = 1176 values.

Audio (Whisper's feature extractor, 128 mel bins as in Whisper large-v3 and Qwen2-Audio): decoded
with soundfile, mixed to mono, resampled to 16 kHz with `scipy.signal.resample_poly`, then
log-mel features with a 25 ms window (n_fft 400, periodic Hann), a 10 ms hop (160 samples, 100
mel frames/s), the Slaney mel filterbank and Whisper's log10 / max-8 dB / (x+4)/4 scaling.
Frame count, defined so that it always matches the count: the encoder runs at
`AudioConfig.encoder_frames_per_s` (Whisper: 50/s after its stride-2 convolution), so each
encoder frame covers `stride = 100 / encoder_frames_per_s` mel frames (Whisper: 2; this must be
a whole number). The clip's encoder length comes from `counting.audio_lengths` on the decoded
duration (the header's rule, so a lying header is caught here); the 16 kHz waveform is
zero-padded (or trimmed, for resampling round-off) to exactly `stride * enc_len * 160` samples,
which with Whisper's centred STFT and its last frame dropped gives `stride * enc_len` mel frames.
With `pad_window_s` the clip is zero-padded to whole windows (Whisper's 30 s), as counted. The
result is time-major and grouped per encoder frame: shape `[enc_len, stride * 128]`, row k
holding mel frames stride*k .. stride*k+stride-1 one after the other (reshape to
`[stride * enc_len, 128]` for a convolutional stem).

Results are float16 (`PREPROCESS_DTYPE`) in both placements, so trainer- and datanode-side
preprocessing give identical tensors (on machines of one numpy build and CPU kind; nothing
depends on thread counts: the mel projection sums in a fixed order, not through BLAS); float16's
precision (~1e-3 here) is finer than an 8-bit pixel step after normalization (~0.015), and
models cast to their own dtype.

`PREPROCESSORS` maps a modality to its function: video clips are decoded by
`pipeline.video.video_patches` (PyAV, the `[video]` extra) into the same 1176-value rows.
"""

from __future__ import annotations

import io
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import soundfile
from PIL import Image

from pipeline.counting import (
    AudioConfig, Counter, CountingConfig, ImageConfig, TextConfig, UndecodableError, audio_lengths,
    library_message, smart_resize,
)
from pipeline.video import VideoConfig, count_video, video_patches

#: OpenAI CLIP normalization, which Qwen2-VL's image processor uses (`OPENAI_CLIP_MEAN/STD`).
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
#: Frames per temporal patch (Qwen2-VL); an image repeats its one frame.
TEMPORAL_PATCH = 2

#: Whisper's feature extractor.
SAMPLE_RATE = 16_000
N_FFT = 400  # 25 ms window
HOP = 160  # 10 ms hop
N_MELS = 128
MEL_FRAMES_PER_S = SAMPLE_RATE // HOP  # 100

#: dtype of every preprocessed array, on the trainer and on the wire alike.
PREPROCESS_DTYPE = np.dtype("float16")


class PreprocessError(ValueError):
    """An item that cannot become its model input; the message names sample key and member."""

    def __init__(self, message: str, modality: str | None = None, *,
                 undecodable: bool = False, mismatch: bool = False,
                 header_lies: bool | None = None) -> None:
        super().__init__(message)  # args: (message,); the rest pickles in __dict__
        self.modality = modality
        self.undecodable = undecodable  # the payload does not decode (not a rules mismatch)
        self.mismatch = mismatch  # it decodes to other rows than the plan counted
        # For a mismatch, the item's header recounted here by this side's rules: True, it counts
        # the planned length (the rules agree, the file lies); False, another one (the rules
        # differ); None, not recounted (a header these rules refuse).
        self.header_lies = header_lies


class RowsMismatch(ValueError):
    """An item's input has other rows than the plan counted (`check_rows`)."""

    def __init__(self, message: str, rows: int = -1, enc_len: int = -1) -> None:
        super().__init__(message)  # args: (message,), so it unpickles; the rest in __dict__
        self.rows = rows
        self.enc_len = enc_len


@dataclass(kw_only=True, slots=True)
class PreprocessConfig:
    """The counting rules the preprocessed lengths must agree with (the data nodes' rules)."""

    image: ImageConfig = field(default_factory=ImageConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    video: VideoConfig = field(default_factory=VideoConfig)

    @staticmethod
    def of(counting) -> PreprocessConfig:
        """The preprocessing rules of a `CountingConfig` (the same image, audio and video rules)."""
        return PreprocessConfig(image=counting.image, audio=counting.audio, video=counting.video)

    def identity(self) -> dict[str, int | float | None]:
        """The rules that shape model inputs, flat (`image.patch_size`: 14, ...): data nodes and
        trainers state them in their HELLO and the dispatcher refuses a peer that disagrees.
        Validity limits (largest header, longest clip) are left out: they decide which samples
        are used, not what a used sample becomes."""
        image, audio, video = self.image, self.audio, self.video
        return {
            **{f"image.{k}": getattr(image, k) for k in _IMAGE_RULES},
            **{f"audio.{k}": getattr(audio, k) for k in _AUDIO_RULES},
            **{f"video.{k}": getattr(video, k) for k in _VIDEO_RULES},
        }


_IMAGE_RULES = ("patch_size", "merge_size", "min_pixels", "max_pixels")
_AUDIO_RULES = ("encoder_frames_per_s", "llm_tokens_per_s", "pad_window_s")
_VIDEO_RULES = ("fps", "temporal_patch", "patch_size", "merge_size", "min_pixels", "max_pixels",
                "min_frames", "max_frames", "total_pixels")


# ---------------------------------------------------------------------------------- images
def image_row_dim(cfg: ImageConfig) -> int:
    """Values per patch row: 3 channels x temporal patch x patch x patch (1176 for Qwen2-VL)."""
    return 3 * TEMPORAL_PATCH * cfg.patch_size**2


def patchify(frames: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """[T, 3, H, W] normalized frames (T a multiple of 2) -> Qwen2-VL patch rows.

    Rows are ordered (t, H/(p*m), W/(p*m), m, m): each merge x merge group is contiguous.
    A row is (channel, temporal, patch_h, patch_w), flattened.
    """
    p, m = cfg.patch_size, cfg.merge_size
    t, c, h, w = frames.shape
    if t % TEMPORAL_PATCH or h % (p * m) or w % (p * m):
        raise ValueError(f"frames of shape {frames.shape} do not tile into temporal patches of "
                         f"{TEMPORAL_PATCH} and spatial groups of {p * m} pixels")
    gt, gh, gw = t // TEMPORAL_PATCH, h // p, w // p
    x = frames.reshape(gt, TEMPORAL_PATCH, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * TEMPORAL_PATCH * p * p)


#: Pillow's modes of more than 8 bits a sample that `convert` clips at 255 instead of scaling:
#: a 16-bit grayscale PNG opens as I;16 (as I in older Pillow), every value above 255 white.
_WIDE_GRAY = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def _wide_gray_rgba(im: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (`_WIDE_GRAY`) as 8-bit RGBA: each value v in [0, 65535] becomes
    round(v / 257), so 65535 is 255 (mode I is read as 16-bit values, clipped to that range);
    the pixels of a PNG tRNS gray value become transparent."""
    wide = np.asarray(im).astype(np.int64)
    gray = ((np.clip(wide, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)
    alpha = np.full(gray.shape, 255, np.uint8)
    transparent = im.info.get("transparency")
    if isinstance(transparent, int):
        alpha[wide == transparent] = 0
    return Image.fromarray(np.dstack([gray, gray, gray, alpha]), "RGBA")


def decode_image(data: bytes | memoryview) -> Image.Image:
    """The image (first frame of an animation) as RGB; transparency is composited over white,
    as transformers' `convert_rgb` does for Qwen2-VL. 16-bit grayscale is scaled to 8 bits
    (`_wide_gray_rgba`), where Pillow's `convert` would clip it to white."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.mode == "RGB":
                return im.convert("RGB")  # loads the pixels before the file closes
            rgba = _wide_gray_rgba(im) if im.mode in _WIDE_GRAY else im.convert("RGBA")
    except Exception as e:  # Pillow raises many types on bad input: all mean "not decodable"
        raise UndecodableError(f"image cannot be decoded: {library_message(e)}") from None
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def normalized_frame(img: Image.Image, cfg: ImageConfig) -> np.ndarray:
    """The image resized by `smart_resize` (BICUBIC) and normalized: float32 [3, h_bar, w_bar]."""
    h_bar, w_bar = smart_resize(img.height, img.width, cfg)
    if (img.width, img.height) != (w_bar, h_bar):
        img = img.resize((w_bar, h_bar), Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.float32)  # [H, W, 3]
    scale = np.float32(1 / 255) / np.asarray(IMAGE_STD, dtype=np.float32)
    shift = np.asarray(IMAGE_MEAN, dtype=np.float32) / np.asarray(IMAGE_STD, dtype=np.float32)
    return (arr * scale - shift).transpose(2, 0, 1)


def image_patches(data: bytes | memoryview, config: PreprocessConfig) -> np.ndarray:
    """Image bytes -> [(h_bar/p) * (w_bar/p), 3*2*p*p] float16 patch rows (see module doc)."""
    frame = normalized_frame(decode_image(data), config.image)
    frames = np.broadcast_to(frame[None], (TEMPORAL_PATCH, *frame.shape))
    return patchify(frames, config.image).astype(PREPROCESS_DTYPE)


# ----------------------------------------------------------------------------------- audio
def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """Slaney's mel scale (librosa's `htk=False`): linear below 1 kHz (3 mels per 200 Hz),
    logarithmic above (27 mels per factor 6.4)."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    log_part = min_log_mel + np.log(np.maximum(hz, min_log_hz) / min_log_hz) / logstep
    return np.where(hz >= min_log_hz, log_part, hz / f_sp)


def mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    """Inverse of `hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), f_sp * mel)


def mel_filters(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS) -> np.ndarray:
    """[n_mels, n_fft//2 + 1] Slaney-normalized triangular mel filters from 0 Hz to Nyquist.

    The construction of `librosa.filters.mel(htk=False, norm="slaney")`, which Whisper's
    `mel_filters.npz` was made with: triangles between consecutive mel-spaced edges, each scaled
    by 2 / (bandwidth in Hz) so every filter has unit area. Checked against librosa 0.11's
    `filters.mel(sr=16000, n_fft=400, n_mels=128)`: equal to float32 precision (tests keep a
    few of its filters); librosa itself is not a dependency (it brings numba and llvmlite).
    """
    fft_hz = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_hz[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return (weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)


_MEL = mel_filters()


@functools.cache
def _window() -> np.ndarray:
    """The STFT's periodic Hann window, as torch.hann_window. scipy.signal is imported on
    first use: a data node that only counts never needs it (0.7 s of CPU at every start)."""
    from scipy.signal import get_window

    return get_window("hann", N_FFT).astype(np.float32)


def _mel_bands(mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bins [n_mels, w], weights [n_mels, w]): each filter's contiguous nonzero bins (w the
    widest; a shorter filter's extra weights are 0), for `_project`."""
    lo = np.array([np.flatnonzero(row)[0] if row.any() else 0 for row in mel])
    width = max(int(np.flatnonzero(row)[-1]) - first + 1 if row.any() else 1
                for row, first in zip(mel, lo))
    bins = np.minimum(lo[:, None] + np.arange(width), mel.shape[1] - 1)
    weights = np.where(lo[:, None] + np.arange(width) < mel.shape[1],
                       np.take_along_axis(mel, bins, axis=1), 0.0).astype(np.float32)
    return bins, weights


_MEL_BINS, _MEL_WEIGHTS = _mel_bands(_MEL)


def _project(power: np.ndarray) -> np.ndarray:
    """`power @ _MEL.T`, summed bin by bin in a fixed order (each filter covers <= 9 bins):
    a BLAS matmul sums in an order that depends on its thread count, so a data node's and a
    16-thread trainer's log-mels differed in the last bit, and their float16 inputs with it."""
    out = power[:, _MEL_BINS[:, 0]] * _MEL_WEIGHTS[:, 0]
    for j in range(1, _MEL_BINS.shape[1]):
        out += power[:, _MEL_BINS[:, j]] * _MEL_WEIGHTS[:, j]
    return out


def mel_stride(cfg: AudioConfig) -> int:
    """Mel frames per encoder frame: 100 / encoder_frames_per_s, which must be a whole number."""
    stride = MEL_FRAMES_PER_S / cfg.encoder_frames_per_s
    if abs(stride - round(stride)) > 1e-9 or round(stride) < 1:
        raise ValueError(f"audio encoder_frames_per_s={cfg.encoder_frames_per_s:g} does not divide "
                         f"the {MEL_FRAMES_PER_S} mel frames/s of a 10 ms hop: choose 100/k frames/s "
                         f"(Whisper: 50)")
    return int(round(stride))


def audio_row_dim(cfg: AudioConfig) -> int:
    """Values per encoder-frame row: stride x 128 mel bins (256 for Whisper)."""
    return mel_stride(cfg) * N_MELS


def log_mel(wave: np.ndarray, num_frames: int) -> np.ndarray:
    """Whisper's log-mel of a 16 kHz waveform: [num_frames, 128] float32, time-major.

    The waveform is zero-padded or trimmed to num_frames * 160 samples; the STFT is centred
    (reflect padding of n_fft/2) and its last frame dropped, as Whisper does.
    """
    n = num_frames * HOP
    wave = np.asarray(wave, dtype=np.float32)[:n]
    if wave.size < n:
        wave = np.pad(wave, (0, n - wave.size))
    padded = np.pad(wave, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:num_frames]
    with np.errstate(over="ignore", invalid="ignore"):
        mel = _project((np.abs(np.fft.rfft(frames * _window(), axis=1)) ** 2).astype(np.float32))
    if not np.isfinite(mel).all():  # samples far past full scale overflow float32: in float64
        mel = _project(np.abs(np.fft.rfft(frames.astype(np.float64) * _window(), axis=1)) ** 2)
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max(initial=-10.0) - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32, copy=False)


def decode_audio(data: bytes | memoryview) -> tuple[np.ndarray, int]:
    """(mono float32 waveform, sample rate) of an audio file (WAV/FLAC/OGG/MP3)."""
    try:
        wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # libsndfile reports every malformed input as a RuntimeError
        raise UndecodableError(f"audio cannot be decoded: {library_message(e)}") from None
    finite = np.isfinite(wave)
    if not finite.all():  # a float WAV may hold them; one would make every mel value NaN
        at = int(np.argmin(finite.all(axis=1)))
        raise UndecodableError(f"audio holds NaN or infinite samples (the first at sample {at} "
                               f"of {len(wave)}): its input would be NaN throughout")
    return wave.mean(axis=1), int(rate)


def resample(wave: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """`wave` from `rate` to `target` Hz with scipy's polyphase filter (Kaiser window)."""
    if rate == target:
        return wave
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return resample_poly(wave, target // g, rate // g).astype(np.float32)


def audio_features(data: bytes | memoryview, config: PreprocessConfig) -> np.ndarray:
    """Audio bytes -> [enc_len, stride * 128] float16 log-mel rows (see module doc)."""
    cfg = config.audio
    stride = mel_stride(cfg)
    wave, rate = decode_audio(data)
    if wave.size == 0:
        raise UndecodableError("audio clip decodes to no samples: it is empty or truncated")
    enc_len, _ = audio_lengths(wave.size / rate, cfg)
    mel = log_mel(resample(wave, rate), stride * enc_len)
    return mel.reshape(enc_len, stride * N_MELS).astype(PREPROCESS_DTYPE)


# ---------------------------------------------------------------------------------- video
def video_features(data: bytes | memoryview, config: PreprocessConfig, meta: dict) -> np.ndarray:
    """Clip bytes -> [enc_len, 3*2*p*p] float16 patch rows: frames sampled, resized and laid
    out as counted (`pipeline.video.video_patches`, from the item's counted `meta`)."""
    return video_patches(data, meta, config.video).astype(PREPROCESS_DTYPE)


# -------------------------------------------------------------------------------- registry
Preprocessor = Callable[[bytes | memoryview, PreprocessConfig, dict], np.ndarray]

#: modality -> function(member bytes, config, the item's counted meta) -> [enc_len, row_dim].
PREPROCESSORS: dict[str, Preprocessor] = {
    "image": lambda data, config, meta: image_patches(data, config),
    "audio": lambda data, config, meta: audio_features(data, config),
    "video": video_features,
}


def row_dim(modality: str, config: PreprocessConfig) -> int:
    """Values per row of a modality's preprocessed array."""
    if modality == "image":
        return image_row_dim(config.image)
    if modality == "video":
        v = config.video
        return 3 * v.temporal_patch * v.patch_size**2
    if modality == "audio":
        return audio_row_dim(config.audio)
    raise ValueError(f"no row size known for modality {modality!r}")


def preprocess_item(modality: str, data: bytes | memoryview, config: PreprocessConfig, *,
                    enc_len: int, key: str, member: str, meta: dict | None = None,
                    on_datanode: bool = False) -> np.ndarray:
    """The model input of one item, checked to have exactly `enc_len` rows (the plan's count).
    `on_datanode`: preprocessed by a data node, whose messages leave out the hint to do so.

    PreprocessError (a ValueError) naming the sample key and member when the item cannot be
    decoded, no preprocessor handles its modality, or its rows disagree with the plan.
    """
    fn = PREPROCESSORS.get(modality)
    if fn is None:
        raise PreprocessError(f"sample {key!r} member {member!r}: no preprocessor for modality "
                              f"{modality!r} (known: {', '.join(sorted(PREPROCESSORS))})", modality)
    try:
        out = fn(data, config, meta or {})
        check_rows(out, enc_len, key=key, member=member, on_datanode=on_datanode)
    except PreprocessError:
        raise
    except RowsMismatch as e:
        raise _recounted(e, modality, data, config, key=key, member=member,
                         on_datanode=on_datanode) from None
    except ValueError as e:
        raise PreprocessError(str(e) if str(e).startswith("sample ")
                              else f"sample {key!r} member {member!r}: {e}", modality,
                              undecodable=isinstance(e, UndecodableError)) from None
    return out


_SKIPPED_ON_DATANODE = "`read --preprocess-on datanode` skips such files on the data node, counted"
_RULE_FLAGS = "--max-pixels, --patch-size, --audio-frames-per-s..."


def _datanode_hint(on_datanode: bool, template: str) -> str:
    """`template` filled with the hint to preprocess on the data node; empty where a data node
    is the one preprocessing (the flag is already in use there)."""
    return "" if on_datanode else template.format(_SKIPPED_ON_DATANODE)


def check_rows(array, enc_len: int, *, key: str, member: str, on_datanode: bool = False) -> None:
    """RowsMismatch naming the sample and member unless `array` has exactly `enc_len` rows."""
    rows = int(array.shape[0]) if getattr(array, "ndim", 0) >= 1 else -1
    if rows != int(enc_len):
        raise RowsMismatch(f"sample {key!r} member {member!r}: preprocessed to {rows} rows but the "
                           f"plan counted enc_len={int(enc_len)}: its header states another length "
                           f"than it decodes to{_datanode_hint(on_datanode, ' (then {})')}, or data "
                           f"node and trainer count by other rules ({_RULE_FLAGS})", rows, int(enc_len))


def header_enc_len(modality: str, data: bytes | memoryview, config: PreprocessConfig) -> int | None:
    """The encoder length these rules count from an item's own header, by the very function a
    data node counts with (`Counter.image`/`audio`, `count_video`); None where they refuse it."""
    try:
        if modality == "video":
            return count_video(data, config.video)[0]
        counter = Counter(CountingConfig(image=config.image, audio=config.audio, video=config.video,
                                         text=TextConfig(estimate=True)))  # no tokenizer to load
        count = {"image": counter.image, "audio": counter.audio}.get(modality)
        return None if count is None else count(data)[0]
    except ValueError:  # CountError: these rules refuse the header, so they say nothing here
        return None


def _recounted(e: RowsMismatch, modality: str, data: bytes | memoryview, config: PreprocessConfig,
               *, key: str, member: str, on_datanode: bool = False) -> PreprocessError:
    """The PreprocessError of an item that decoded to other rows than planned, decided by
    recounting its header here: the planned length (the file lies) or another (rules differ)."""
    counted = header_enc_len(modality, data, config)
    what = f"sample {key!r} member {member!r}"
    if counted is None:
        return PreprocessError(str(e), modality, mismatch=True)
    if counted == e.enc_len:
        return PreprocessError(
            f"{what}: preprocessed to {e.rows} rows but its header counts enc_len={e.enc_len}, "
            f"here as in the plan: its header states another length than it decodes to"
            f"{_datanode_hint(on_datanode, ' ({})')}", modality, mismatch=True, header_lies=True)
    return PreprocessError(
        f"{what}: the plan counted enc_len={e.enc_len} but the rules here count its header as "
        f"{counted} (it preprocessed to {e.rows} rows): data node and trainer count by other "
        f"rules ({_RULE_FLAGS})", modality, mismatch=True, header_lies=False)


# ------------------------------------------------------------------- tensors on the wire
#: Item meta key under which a data node describes a shipped array (`--preprocess-on datanode`).
TENSOR_META = "tensor"


def tensor_meta(array: np.ndarray) -> dict:
    """The item meta entry describing an array shipped as raw bytes."""
    return {"shape": [int(n) for n in array.shape], "dtype": array.dtype.str}


def preprocess_record(rec, config: PreprocessConfig) -> None:
    """Replace a `SampleRecord`'s item members by their preprocessed arrays (a data node's
    `--preprocess-on datanode`), each item's meta describing its array under `TENSOR_META`.
    ValueError naming the sample key and member when an item cannot be preprocessed."""
    for it in rec.items:
        arr = preprocess_item(it.modality, rec.members[it.member], config, enc_len=it.enc_len,
                              key=rec.key, member=it.member, meta=it.meta, on_datanode=True)
        rec.members[it.member] = np.ascontiguousarray(arr)
        it.meta = {**it.meta, TENSOR_META: tensor_meta(arr)}


def array_from_payload(payload: bytes | memoryview, meta: dict) -> np.ndarray:
    """The array a data node shipped (a read-only view over `payload`, no copy)."""
    desc = meta[TENSOR_META]
    shape, dtype = tuple(int(n) for n in desc["shape"]), np.dtype(desc["dtype"])
    if math.prod(shape) * dtype.itemsize != memoryview(payload).nbytes:
        raise ValueError(f"tensor payload of {memoryview(payload).nbytes} bytes does not hold "
                         f"shape {list(shape)} of {dtype}")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)


__all__ = [
    "IMAGE_MEAN", "IMAGE_STD", "N_MELS", "PREPROCESSORS", "PREPROCESS_DTYPE", "PreprocessConfig",
    "PreprocessError",
    "TEMPORAL_PATCH", "TENSOR_META", "RowsMismatch", "array_from_payload", "audio_features", "check_rows",
    "header_enc_len", "image_patches", "log_mel", "mel_filters", "mel_stride", "patchify",
    "preprocess_item",
    "preprocess_record",
    "row_dim", "tensor_meta",
]
