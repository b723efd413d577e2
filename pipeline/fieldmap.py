"""Field map: which member suffixes of a sample are images, audio, video, plain text or a conversation.

A member `KEY.SUFFIX` is classified by the extension of its suffix (the part after the last
dot, lower-cased: `0.jpg` and `seg.JPG` are both `jpg`); a `.gz` text or conversation member
(`txt.gz`, `json.gz`) is inflated first. A member whose extension no kind names is *ignored*:
carried along but neither counted nor sent as an item, and counted by its label (`ignored_label`)
so nothing is dropped silently. Light module: imports nothing of ours beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: The kinds a field map names, in the order `to_dict` writes them.
KINDS: tuple[str, ...] = ("image", "audio", "video", "text", "conversation")
#: Kinds whose members may arrive gzip-compressed (`txt.gz`): they are inflated before counting.
GZIP_KINDS: frozenset[str] = frozenset({"text", "conversation"})


#: Extensions of image and audio formats the counters refuse by name (pipeline.counting): in
#: the default map, so that a sample holding one is refused, not trained without it.
REFUSED_IMAGE: tuple[str, ...] = ("bmp", "tif", "tiff", "ico", "heic", "heif", "avif", "jp2", "jxl")
REFUSED_AUDIO: tuple[str, ...] = ("m4a", "m4b", "aac", "wma", "amr")


def _extension(suffix: str) -> str:
    return suffix[suffix.rfind(".") + 1 :].lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldMap:
    """Extensions per kind; defaults are the suffixes webdataset datasets use most.

    Defaults: image jpg/jpeg/png/webp/gif, audio wav/flac/mp3/ogg/opus/oga/aiff/aif, video
    mp4/m4v/mov/webm/mkv/avi,
    text txt/text, conversation json. Images and audio in formats the trainers do not decode
    (`REFUSED_IMAGE`, `REFUSED_AUDIO`: BMP, TIFF, HEIC, M4A, AAC...) are mapped too, so that
    such a member is refused naming its format and the fix (convert it) instead of ignored: its
    sample would train without it (a transcript without its clip). Mapping a kind's extensions
    yourself leaves them out unless listed. A conversation member is JSON: an object whose first
    field among `TextConfig.json_fields` (text, caption, conversations, messages) holds a string
    or a list of {role, content} turns. Frozen and made of tuples, so it hashes and its repr
    is stable (the reader caches its sample builders by the config's repr).
    """

    image: tuple[str, ...] = ("jpg", "jpeg", "png", "webp", "gif", *REFUSED_IMAGE)
    audio: tuple[str, ...] = ("wav", "flac", "mp3", "ogg", "opus", "oga", "aiff", "aif",
                              *REFUSED_AUDIO)
    video: tuple[str, ...] = ("mp4", "m4v", "mov", "webm", "mkv", "avi")
    text: tuple[str, ...] = ("txt", "text")
    conversation: tuple[str, ...] = ("json",)

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for kind in KINDS:
            exts = getattr(self, kind)
            if isinstance(exts, str) or not isinstance(exts, tuple):
                raise ValueError(f"field map {kind}: expected a tuple of extensions, got {exts!r}")
            for ext in exts:
                if not isinstance(ext, str) or not ext or "." in ext or "/" in ext or ext != ext.lower():
                    raise ValueError(f"field map {kind}: extension {ext!r} must be a non-empty "
                                     f"lower-case name without dots or slashes (e.g. 'png')")
                if ext == "gz":
                    raise ValueError(f"field map {kind}: 'gz' is not an extension to map; a "
                                     f"compressed text member 'txt.gz' is text when 'txt' is")
                if ext in seen:
                    raise ValueError(f"field map: extension {ext!r} is mapped to both {seen[ext]} "
                                     f"and {kind}; map it once")
                seen[ext] = kind

    @classmethod
    def from_dict(cls, data: object) -> FieldMap:
        """A field map from `{kind: [extensions]}`; kinds left out keep their defaults, an
        empty list maps nothing to that kind. Extensions may be written with a leading dot or in
        upper case (`.PNG` is `png`). ValueError naming an unknown kind or a doubly mapped
        extension."""
        if not isinstance(data, dict):
            raise ValueError(f"field map: expected a mapping of kind to extensions, got "
                             f"{type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in KINDS)
        if unknown:
            raise ValueError(f"field map: unknown kind {unknown[0]!r}; kinds are {', '.join(KINDS)}")
        values = {}
        for kind, exts in data.items():
            if isinstance(exts, str) or not isinstance(exts, (list, tuple)):
                raise ValueError(f"field map {kind}: expected a list of extensions (e.g. "
                                 f'{kind} = ["{getattr(cls(), kind)[0]}"]), got {exts!r}')
            if not all(isinstance(e, str) for e in exts):
                raise ValueError(f"field map {kind}: extensions must be strings, got {list(exts)!r}")
            values[kind] = tuple(e.strip().lstrip(".").lower() for e in exts)
        defaults = cls()
        # A kind given explicitly takes its extensions from every kind left at its default:
        # `{"text": ["txt", "json"]}` moves json from conversation to text instead of failing
        # (a JSON member is read for its text field under either kind).
        given = {e: kind for kind, exts in values.items() for e in exts}
        for kind in KINDS:
            if kind not in values:
                values[kind] = tuple(e for e in getattr(defaults, kind) if e not in given)
        return cls(**values)

    def to_dict(self) -> dict[str, list[str]]:
        """`{kind: [extensions]}` for every kind; `from_dict` of it gives this map back."""
        return {kind: list(getattr(self, kind)) for kind in KINDS}

    def kinds(self) -> dict[str, str]:
        """extension -> kind."""
        return {ext: f.name for f in fields(self) for ext in getattr(self, f.name)}

    def classify(self, suffix: str) -> tuple[str | None, str]:
        """(kind, extension) of a member suffix; kind None for a member no kind names.

        A `.gz` member is classified by the extension under it (`txt.gz` -> text, "txt") when
        that kind is text or conversation (see `is_gzip`); any other `.gz` member is ignored.
        """
        ext = _extension(suffix)
        if ext == "gz":
            inner = _extension(suffix[: suffix.rfind(".")]) if "." in suffix else ""
            kind = self.kinds().get(inner)
            return (kind, inner) if kind in GZIP_KINDS else (None, inner)
        return self.kinds().get(ext), ext


def is_gzip(suffix: str) -> bool:
    """Whether a member suffix names a gzip file (`txt.gz`)."""
    return _extension(suffix) == "gz"


def ignored_label(suffix: str) -> str:
    """The label an ignored member is counted under: its extension (`0.cls` -> "cls"), with a
    `.gz` kept as part of it (`npy.gz`); "" for a member name without any suffix."""
    ext = _extension(suffix) if suffix else ""
    if ext == "gz" and "." in suffix:
        return f"{_extension(suffix[: suffix.rfind('.')])}.gz"
    return ext


__all__ = ["FieldMap", "GZIP_KINDS", "KINDS", "REFUSED_AUDIO", "REFUSED_IMAGE", "ignored_label", "is_gzip"]
