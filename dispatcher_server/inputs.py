"""The rules the session's model inputs follow, as its peers state them; a peer that disagrees is refused.

Data nodes count and tokenize, trainers build tensors and size their vocabulary: both must use
the same patch size, pixel budgets, audio and video rates and tokenizer, or a job trains on ids
and lengths its model does not expect (an embedding index error at best). Each peer states the
rules it knows in its HELLO (`inputs`: a flat dict, e.g. `image.patch_size`, `tokenizer`); the
first statement of a rule becomes the session's, and a later peer stating another value for it
is refused with one line naming every rule that differs and who stated the session's value.
Rules a peer does not state are not checked for it.

With a journal the session's rules are kept beside it (`inputs.json`): a dispatcher restarted
on the journal holds its readers and ranks to them, as it held the peers before the restart (a
reader restarted with another tokenizer or other placeholders had its samples planned anew,
unlike the journal's, step after step, with only an error count to show for it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from dispatcher_server.files import check_regular_file, replace_file
from dispatcher_server.recordlog import write_error

INPUTS_FILE = "inputs.json"
#: Who stated a rule the journal kept, in refusals.
FROM_JOURNAL = "this job's journal"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class InputRules:
    """The session's input rules: first statement wins; later statements must agree."""

    def __init__(self) -> None:
        self.rules: dict[str, object] = {}
        self.stated_by: dict[str, str] = {}
        self.path: str | None = None

    def keep_beside(self, directory: str, resume: bool) -> None:
        """Keep the rules in `directory` (the journal's); when the journal resumes a job, the
        rules it kept are the session's from the start. A new job forgets an earlier one's."""
        self.path = os.path.join(directory, INPUTS_FILE)
        if not resume:
            if os.path.exists(self.path):
                os.unlink(self.path)
            return
        try:
            check_regular_file(self.path)  # a named pipe would block the start for good
            with open(self.path, encoding="utf-8") as f:
                kept = json.load(f)
        except FileNotFoundError:
            return  # a journal written before the rules were kept, or before any peer came
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise ValueError(f"{self.path} is unreadable ({why}): remove it, and the first "
                             "peers to connect state the job's input rules again") from None
        if not isinstance(kept, dict):
            raise ValueError(f"{self.path} holds no rules table: remove it, and the first peers "
                             "to connect state the job's input rules again")
        self.rules.update(kept)
        self.stated_by.update(dict.fromkeys(kept, FROM_JOURNAL))

    def admit(self, peer: str, theirs: dict | None,
              present: Callable[[], set[str]] | None = None) -> str | None:
        """Why `peer`'s rules conflict with the session's (one line), or None once its rules
        have joined the session's. `present` gives the peers connected now: a rule stated by
        one that left is still the session's (what it sent was counted by it), and the line
        says that only a restart of the dispatcher changes it. Raises JournalWriteError when the
        journal cannot keep the new rules (disk full): then nothing of them was admitted."""
        if not theirs:
            return None
        differ = [k for k in sorted(theirs) if k in self.rules and theirs[k] != self.rules[k]]
        if differ:
            parts = "; ".join(f"{k}: {peer} {_show(theirs[k])}, {self.stated_by[k]} "
                              f"{_show(self.rules[k])}" for k in differ)
            here = present() if present is not None else None
            gone = sorted({self.stated_by[k] for k in differ} - here) if here is not None else []
            fix = "give data nodes and trainers the same [counting] table (or flags) and tokenizer"
            if any(self.stated_by[k] == FROM_JOURNAL for k in differ):
                # The rules decide which samples are kept, and shuffle blocks are filled with
                # the kept ones: other rules that keep or skip other samples move every block
                # after the commit, so a resume trains some committed samples again and never
                # others. Only rules that keep the same samples resume.
                fix += (f" as the job had; to resume by new rules that keep and skip the same "
                        f"samples (another tokenizer or template), stop the dispatcher, remove "
                        f"{self.path} and start it again (the uncommitted steps are then planned "
                        "anew); rules that keep or skip other samples (--max-seq-len, "
                        "placeholders, fields, --max-member-bytes and the other limits) make "
                        "another sample sequence: start a new job (a new --journal-dir, "
                        "trainers without their data state)")
            elif gone:
                fix += (f"; {' and '.join(gone)} left, but the session keeps the rules first "
                        "stated (what was sent was counted by them) until the dispatcher "
                        "restarts: restart it once every peer agrees")
            return f"{peer} builds model inputs by other rules than this session ({parts}): {fix}"
        new = {k: v for k, v in theirs.items() if k not in self.rules}
        if new:
            for k, v in new.items():
                self.rules[k], self.stated_by[k] = v, peer
            if self.path is not None:
                try:
                    replace_file(self.path, json.dumps(self.rules, sort_keys=True).encode())
                except OSError as e:
                    for k in new:
                        del self.rules[k], self.stated_by[k]
                    raise write_error(e, self.path) from e
        return None
