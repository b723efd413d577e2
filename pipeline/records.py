"""The data model of a counted sample, as data nodes produce it.

A record carries counts (what the planner needs) and the raw member bytes (what the trainer
needs) side by side, so counting never forces a decode and shipping never forces a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.tokenize import TextTokens

#: Modality of an item -> the encoder phase that processes it.
MODALITY_PHASE: dict[str, str] = {"image": "vision", "video": "vision", "audio": "audio"}


@dataclass(slots=True, kw_only=True)
class Item:
    """One image, video or audio clip of a sample, with its token counts."""

    modality: str  # "image" | "video" | "audio"
    member: str  # member suffix inside the sample, e.g. "0.jpg" or "wav"
    enc_len: int  # sequence length its encoder attends over (patches, frames)
    llm_len: int  # embeddings it becomes in the LLM sequence
    meta: dict = field(default_factory=dict)  # header facts: width/height, duration_s, sample_rate...

    @property
    def phase(self) -> str:
        return MODALITY_PHASE[self.modality]


@dataclass(slots=True, kw_only=True)
class SampleRecord:
    """A counted sample: key, where it came from, its items, and its raw members.

    `llm_len == text_len + sum(item.llm_len for item in items)`. Item order is the order of
    the sample's LLM sequence (images, videos, audio clips, then text), see the planner, except
    that an item anchored at a placeholder (`meta["anchor"]`) stands after that many text tokens.
    """

    key: str
    shard: str  # shard URL as given in the shard list
    index: int  # position of the sample in its shard
    items: list[Item]
    text_len: int
    llm_len: int
    # the text's token ids and loss mask (len == text_len); empty when text_len was only
    # estimated (`inspect --estimate-text`)
    tokens: TextTokens = field(default_factory=TextTokens.empty)
    members: dict[str, bytes | memoryview] = field(default_factory=dict)  # suffix -> raw bytes
    # suffix -> (offset, size) of each item's bytes in the shard file; filled on request
    # (`iter_shard(spans=True)`) for payloads sent by reference.
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    # text tokens cut from the end to fit --max-seq-len (`--over-length truncate`); 0: whole
    truncated: int = 0
    # where the next sample (index + 1) begins in the shard's tar, or the archive's end; -1:
    # unknown (asked of `iter_shard(resume_points=True)`: a resumed read starts there)
    next_at: int = -1

    @property
    def modality_mix(self) -> str:
        """Canonical name of the sample's mix, e.g. 'image+audio+text' or 'text'."""
        kinds = sorted({it.modality for it in self.items})
        return "+".join([*kinds, "text"]) if self.text_len else "+".join(kinds) or "empty"
