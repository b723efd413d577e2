"""The dataset file: the sources a job blends, each with its shards, weight and field map.

TOML, like the settings file (`--config`): the standard library reads it (no YAML dependency),
it has comments, and its types are explicit (YAML reads `no` as false and `1e3` as a string).
It is parsed strictly by pydantic: an unknown key or a wrong type is one line naming the file,
the key and what was expected.

    shuffle_buffer = 1000          # optional: samples per seeded shuffle block (0: off)

    [[sources]]
    name = "captions"
    shards = "captions/{000..009}.tar"  # a spec or a list, as --shards takes; relative
                                        # paths are relative to this file (a pipe: command
                                        # runs as written, in each reader's working directory)
    weight = 3

    [sources.fields]                # optional: which member extensions are which kind
    image = ["jpg", "png"]
    text = ["txt"]

Fields: `image`, `audio`, `video`, `text` (plain text) and `conversation` (a JSON list of
`{role, content}` turns); a source without `fields` uses the readers' default map. Members no
kind names are counted by suffix, never silently dropped.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from dispatcher_server.config import Source, weight_problem
from mmdispatch.settings import TOML_TYPES, read_toml
from pipeline.fieldmap import KINDS as FIELD_KINDS, FieldMap
from pipeline.shards import expand_shards, normalized, shard_identity

_Ext = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")]


class FieldsModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    image: list[_Ext] | None = None
    audio: list[_Ext] | None = None
    video: list[_Ext] | None = None
    text: list[_Ext] | None = None
    conversation: list[_Ext] | None = None


class SourceModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")]
    shards: str | list[str]
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    fields: FieldsModel | None = None


class DatasetModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    sources: Annotated[list[SourceModel], Field(min_length=1)]
    shuffle_buffer: Annotated[int, Field(ge=0)] | None = None


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message is one line naming file, key and fix."""


_BRANCHES = ("list[", "str", "function-", "constrained-")  # pydantic's names of a union's types


def _most_specific(errors: list[dict]) -> dict:
    """The first error's field, as the union branch that says most about it: `shards = ["a",
    5]` fails both `str` (the whole list) and `list[str]` (item 1), and the second names the item."""
    def field(error: dict) -> tuple:
        return tuple(p for p in error["loc"] if not str(p).startswith(_BRANCHES))

    first = field(errors[0])
    same = [e for e in errors if field(e)[:len(first)] == first]
    return max(same, key=lambda e: len(field(e)))


def _describe(error: dict, path: str) -> str:
    loc = []
    for part in error["loc"]:
        if isinstance(part, int) and loc:
            loc[-1] = f"{loc[-1]}[{part}]"
        elif not str(part).startswith(_BRANCHES):
            loc.append(str(part))
    where = ".".join(loc) or "(top level)"
    if loc == ["sources"] and error["type"] in ("too_short", "missing"):
        return f"{path}: the dataset file lists no sources; add a [[sources]] table (name, shards)"
    if error["type"] == "extra_forbidden":
        allowed = {"sources": "name, shards, weight, fields", "fields": ", ".join(FIELD_KINDS)}
        parent = loc[-2].split("[")[0] if len(loc) > 1 else ""
        keys = allowed.get(parent, "sources, shuffle_buffer")
        return f"{path}: {where}: unknown key (allowed here: {keys})"
    if error["type"] == "missing":
        return f"{path}: {where}: missing (required)"
    if error["type"] == "string_pattern_mismatch":
        # The names go into metric labels and log lines; the extensions are matched to members.
        what = "a source name" if loc and loc[-1] == "name" else "an extension such as 'jpg'"
        return (f"{path}: {where}: expected {what} (ASCII letters, digits, '_', '.', '-'; not "
                f"starting with '.' or '-'), got {error['input']!r}")
    expected = error["msg"].removeprefix("Input should be ").removeprefix("a valid ").rstrip(".")
    if error["type"] == "model_type":  # pydantic names its model class: the user wrote TOML
        expected = (f"a table of kind = [extensions] (kinds: {', '.join(FIELD_KINDS)})"
                    if loc and loc[-1] == "fields" else "a table")
    got = TOML_TYPES.get(type(error["input"]), type(error["input"]).__name__)
    return f"{path}: {where}: expected {expected}, got {error['input']!r} ({got})"


def _beside(base: str, spec: str) -> str:
    """A shard spec of the dataset file in folder `base`: a relative path (a `file:` URL's too,
    and one with a colon in a name: `ts/2024-01-01T10:00.tar`) joined to it; an absolute path,
    a remote URL or a `pipe:` command as written (their scheme in lower case)."""
    spec = normalized(spec)
    if spec.startswith("pipe:") or "://" in spec:
        return spec
    if spec.startswith("file:"):
        path = spec[len("file:"):]
        return spec if os.path.isabs(path) else "file:" + os.path.join(base, path)
    return spec if os.path.isabs(spec) else os.path.join(base, spec)


def load_dataset(path: str) -> tuple[list[Source], int | None]:
    """The sources a dataset file names (shard specs expanded) and its shuffle buffer, if set.
    DatasetError (one line) for a file that cannot be used."""
    data = read_toml(path, "dataset", DatasetError)
    try:
        model = DatasetModel.model_validate(data)
    except ValidationError as e:
        raise DatasetError(_describe(_most_specific(e.errors()), path)) from None
    names = [s.name for s in model.sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DatasetError(f"{path}: source name {dup[0]!r} is used twice; names must be unique")
    sources = []
    owner: dict[str, str] = {}  # shard identity -> the source that lists it
    for i, src in enumerate(model.sources):
        fields = None
        if src.fields is not None:
            fields = {k: [e.lower().lstrip(".") for e in v]
                      for k, v in src.fields.model_dump().items() if v is not None}
            try:
                FieldMap.from_dict(fields)  # the readers' own checks (one kind per extension)
            except ValueError as e:
                raise DatasetError(f"{path}: sources[{i}].fields: {e}") from None
        specs = [src.shards] if isinstance(src.shards, str) else src.shards
        if not specs or not all(s.strip() for s in specs):
            # An empty spec joined to this file's folder would serve every shard beside it.
            got = "an empty list" if not specs else "an empty path"
            raise DatasetError(f"{path}: sources[{i}] ({src.name!r}).shards: {got}; give shard "
                               "paths, a directory, a glob or a {000..009} range")
        # Relative paths are the file's neighbours, wherever the command runs from; `~/x` is
        # the home directory's, as in a shell (not a folder named `~` beside the file).
        base = os.path.dirname(os.path.abspath(path))
        specs = [os.path.expanduser(s) if s.startswith("~") else s for s in specs]
        specs = [_beside(base, s) for s in specs]
        try:
            shards = expand_shards(specs)
        except (ValueError, OSError) as e:
            raise DatasetError(f"{path}: sources[{i}] ({src.name!r}).shards: {e}") from None
        for url in shards:  # a copied block would serve each of the shard's samples twice
            other = owner.setdefault(shard_identity(url), src.name)
            if other != src.name:
                raise DatasetError(f"{path}: sources[{i}] ({src.name!r}).shards: shard {url!r} is "
                                   f"also in source {other!r}; list each shard in one source")
        sources.append(Source(name=src.name, shards=shards, weight=src.weight, fields=fields))
    if (problem := weight_problem(sources)) is not None:
        i, why = problem
        raise DatasetError(f"{path}: sources[{i}] ({sources[i].name!r}).weight: "
                           f"{sources[i].weight!r} {why}")
    return sources, model.shuffle_buffer
