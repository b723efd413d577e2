"""The rules the session's model inputs follow, as its peers state them; a peer that disagrees is refused.

Data nodes count and tokenize, trainers build tensors and size their vocabulary: both must use
the same patch size, pixel budgets, audio and video rates and tokenizer, or a job trains on ids
and lengths its model does not expect (an embedding index error at best). Each peer states the
rules it knows in its HELLO (`inputs`: a flat dict, e.g. `image.patch_size`, `tokenizer`); the
first statement of a rule becomes the session's, and a later peer stating another value for it
is refused with one line naming every rule that differs and who stated the session's value.
Rules a peer does not state are not checked for it.
"""

from __future__ import annotations

from collections.abc import Callable


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class InputRules:
    """The session's input rules: first statement wins; later statements must agree."""

    def __init__(self) -> None:
        self.rules: dict[str, object] = {}
        self.stated_by: dict[str, str] = {}

    def admit(self, peer: str, theirs: dict | None,
              present: Callable[[], set[str]] | None = None) -> str | None:
        """Why `peer`'s rules conflict with the session's (one line), or None once its rules
        have joined the session's. `present` gives the peers connected now: a rule stated by
        one that left is still the session's (what it sent was counted by it), and the line
        says that only a restart of the dispatcher changes it."""
        if not theirs:
            return None
        differ = [k for k in sorted(theirs) if k in self.rules and theirs[k] != self.rules[k]]
        if differ:
            parts = "; ".join(f"{k}: {peer} {_show(theirs[k])}, {self.stated_by[k]} "
                              f"{_show(self.rules[k])}" for k in differ)
            here = present() if present is not None else None
            gone = sorted({self.stated_by[k] for k in differ} - here) if here is not None else []
            fix = "give data nodes and trainers the same [counting] table (or flags) and tokenizer"
            if gone:
                fix += (f"; {' and '.join(gone)} left, but the session keeps the rules first "
                        "stated (what was sent was counted by them) until the dispatcher "
                        "restarts: restart it once every peer agrees")
            return f"{peer} builds model inputs by other rules than this session ({parts}): {fix}"
        for k, v in theirs.items():
            if k not in self.rules:
                self.rules[k], self.stated_by[k] = v, peer
        return None
