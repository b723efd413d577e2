"""Text to token ids on the data node: a tokenizer, chat templates for conversations, a loss mask.

Readers tokenize, and the ids they compute are the ids the trainer receives, so a sample's
planned text length is exact by construction. Two tokenizers: an HF `tokenizers` JSON file, or
(without one) a byte-level tokenizer whose 256 ids are the UTF-8 bytes. A conversation is
rendered through a jinja2 chat template (HF's convention, with the context transformers'
`apply_chat_template` gives it) and tokenized whole; each turn is located by rendering the
conversation turn by turn (or, for templates that rewrite earlier turns once later ones follow,
by locating each assistant content in the whole rendering; for templates that mark it with
`{% generation %}`, by those marks), and a token is a target when its character span covers
assistant text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from datetime import datetime
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from dispatcher_server.cliopts import event_line, redact
from dispatcher_server.protocol import TOKEN_DTYPES, split_tokens, token_width, tokens_ok

log = logging.getLogger("mmdispatch.tokenize")

#: Ids of the byte-level tokenizer: one per byte value.
BYTE_VOCAB_SIZE = 256

#: ChatML (Qwen, many others): `<|im_start|>ROLE\n CONTENT <|im_end|>\n` per turn.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: Chat templates known by name (`--chat-template chatml`); a tokenizer's own template of the
#: same name wins (`resolve_chat_template`).
BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML}
#: Where newer transformers saves a tokenizer's default chat template, beside its
#: tokenizer_config.json (`_own_templates`)...
TEMPLATE_FILE = "chat_template.jinja"
#: ...and the folder, beside it too, where it saves each other named one as NAME.jinja.
TEMPLATE_DIR = "additional_chat_templates"
#: ShareGPT role names (`from`) and the chat-template roles they stand for.
ROLE_ALIASES: dict[str, str] = {"human": "user", "gpt": "assistant", "chatgpt": "assistant",
                                "bot": "assistant", "model": "assistant",  # model: Gemini's
                                # LLaMA-Factory's ShareGPT tool use: the model's call, its result
                                "function_call": "assistant", "observation": "tool"}
ASSISTANT = "assistant"
#: Stands for an assistant turn's content while locating it in the rendered turn: letters only,
#: so that what templates do to content (Llama 3's and Gemma's `| trim`, which also strips
#: control characters such as \x1e) leaves it whole.
_SENTINEL = "MMDISPATCHxASSISTANTxCONTENTxSENTINEL"
#: Stands for an assistant turn's `reasoning_content` (Qwen3's, DeepSeek-R1's) the same way.
_REASONING_SENTINEL = "MMDISPATCHxASSISTANTxREASONINGxSENTINEL"
#: Where a turn's reasoning opens: its trained span starts at this tag when the rendering has it
#: right before the reasoning (the model generates the tag, as SFT trainers train it).
_THINK = "<think>"
#: Wrap each `{% generation %}` block's output in the tracked render (`generation_segments`):
#: letters only, so no whitespace control or escaping changes them.
_GENERATION_BEGIN = "MMDISPATCHxGENERATIONxBEGIN"
_GENERATION_END = "MMDISPATCHxGENERATIONxEND"
#: The render context variable that switches the wrapping on: the list of blocks rendered.
_GENERATION_TRACK = "_mmdispatch_generation_blocks"


#: Role sequences whose marker cut a template keeps (`ChatTemplate._from_skeleton`).
_MAX_SKELETONS = 4096
_UNCUT = object()


class ChatTemplateError(ValueError):
    """A conversation the chat template refuses, or renders so that no exact mask exists."""


@runtime_checkable
class Tokenizer(Protocol):
    """What readers need of a tokenizer: ids of a text, and how many ids exist."""

    name: str
    vocab_size: int  # every id is < vocab_size

    def encode(self, text: str) -> np.ndarray: ...  # int32 ids, no special tokens added

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...  # ids, [n, 2] char spans


class ByteTokenizer:
    """Byte-level ids: the UTF-8 bytes of the text (exact, lossless, 256 ids)."""

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, [n, 2] spans): each byte stands for the character it is part of."""
        chars = np.repeat(np.arange(len(text), dtype=np.int64),
                          [len(c.encode("utf-8")) for c in text])
        return self.encode(text), np.stack([chars, chars + 1], axis=1)

    @staticmethod
    def decode(ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8")


def missing_file(path: str) -> str:
    """Why `path`, which is not a file, cannot be read as one: for "tokenizer file X <this>"."""
    if os.path.isdir(path):
        inside = os.path.join(path, "tokenizer.json")
        return "is a directory" + (f" (pass {inside!r}, the file in it)"
                                   if os.path.isfile(inside) else "")
    return "does not exist"


class HFTokenizer:
    """An HF `tokenizers` JSON file (a model's tokenizer.json). No special tokens are added:
    BOS/EOS come from the chat template, as the model's own chat format puts them."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HF  # optional dependency, only when configured

        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} {missing_file(path)}: pass an HF tokenizers "
                             f"JSON file (a model's tokenizer.json)")
        try:
            self.tokenizer = _HF.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"tokenizer file {path!r} {_not_a_tokenizer(path, e)}") from None
        # A tokenizer.json saved with truncation or padding on keeps them, and encode() would
        # cut every text to that length or pad it with trained pad ids; the model's tokenizer
        # (transformers) turns both off unless asked. Lengths are --max-seq-len's to hold.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.name = os.path.basename(path)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(int32 ids, int64 [n, 2] character spans of `text` each id stands for)."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, dtype=np.int32), offsets


def _not_a_tokenizer(path: str, error: Exception) -> str:
    """Why `path` did not load as an HF tokenizers file, for "tokenizer file X <this>": a
    tokenizer_config.json or other JSON is named as such (the parser's message says neither)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 << 20)
        obj = json.loads(head)
    except (OSError, ValueError, RecursionError):
        obj = None
    beside = os.path.join(os.path.dirname(path), "tokenizer.json")
    if isinstance(obj, dict) and (os.path.basename(path) == "tokenizer_config.json" or "chat_template" in obj
                                  or "tokenizer_class" in obj or "added_tokens_decoder" in obj):
        return ("is a tokenizer_config.json; pass the tokenizer.json beside it"
                + (f" ({beside!r})" if os.path.isfile(beside) else ""))
    if obj is not None and not (isinstance(obj, dict) and "model" in obj):
        return (f"is JSON but not an HF tokenizers JSON file (a {type(obj).__name__} without a 'model'): "
                f"pass a model's tokenizer.json")
    return f"is not an HF tokenizers JSON file ({error}): pass a model's tokenizer.json"


def tokenizer_identity(path: str | None) -> dict[str, str]:
    """`{"tokenizer": ...}`: `byte-level`, or the SHA-256 (its first 16 hex digits) of the
    tokenizer file's JSON written canonically (keys sorted, no spaces), its `truncation` and
    `padding` left out (readers turn both off): data nodes and trainers are checked to use the
    same ids, and the same tokenizer saved again (indented otherwise, by another version) is the
    same. A file that is no JSON is hashed as its bytes."""
    if path is None:
        return {"tokenizer": "byte-level"}
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"tokenizer file {path!r} cannot be read: {e.strerror or e}") from None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        obj.pop("truncation", None)
        obj.pop("padding", None)
        raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()  # (ASCII: a lone
        # surrogate escape, which some vocabularies hold, has no UTF-8)
    return {"tokenizer": f"sha256:{hashlib.sha256(raw).hexdigest()[:16]}"}


def load_tokenizer(path: str | None) -> Tokenizer:
    """The HF tokenizer in `path`, or the byte-level tokenizer when `path` is None."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


@dataclass(frozen=True, slots=True)
class TextTokens:
    """A sample's text as ids plus its loss mask (1: a training target, 0: context only).

    On the wire (`SampleHeader.tokens`): the ids at the narrowest width that holds them (1, 2 or
    4 bytes), then the mask as bits (`protocol.TOKEN_WIDTHS`).
    """

    ids: np.ndarray  # int32[n]
    mask: np.ndarray  # uint8[n]

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def empty() -> TextTokens:
        return TextTokens(np.zeros(0, np.int32), np.zeros(0, np.uint8))

    @staticmethod
    def plain(ids: np.ndarray) -> TextTokens:
        """Plain text: every token is a target."""
        return TextTokens(np.asarray(ids, np.int32), np.ones(len(ids), np.uint8))

    @staticmethod
    def concat(parts: list[TextTokens]) -> TextTokens:
        if not parts:
            return TextTokens.empty()
        if len(parts) == 1:
            return parts[0]
        return TextTokens(np.concatenate([p.ids for p in parts]), np.concatenate([p.mask for p in parts]))

    def to_wire(self) -> bytes:
        n = len(self.ids)
        if not n:
            return b""
        width = token_width(int(self.ids.max()))
        bits = np.packbits(self.mask.astype(bool), bitorder="little")
        return bytes([width]) + self.ids.astype(TOKEN_DTYPES[width]).tobytes() + bits.tobytes()

    @staticmethod
    def from_wire(data: bytes | memoryview, n: int) -> TextTokens:
        """The `n` tokens of a wire form (ValueError if it does not hold exactly `n`)."""
        if not tokens_ok(data, n):
            raise ValueError(f"{len(data)} token bytes are not a wire form of {n} tokens")
        width, ids, bits = split_tokens(data, n)
        return TextTokens(np.frombuffer(ids, TOKEN_DTYPES[width]).astype(np.int32),
                          np.unpackbits(np.frombuffer(bits, np.uint8), count=n, bitorder="little"))


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    """transformers' `strftime_now`: the current local date and time, formatted (so ids of a
    template that prints today's date, as Llama 3.1+ do, depend on the day, as there)."""
    return datetime.now().strftime(fmt)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple | None = None, sort_keys: bool = False) -> str:
    """The `tojson` filter transformers gives chat templates (jinja2's own escapes <, >, & and
    ' for HTML, so tool calls would render other text than the model was trained to see)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


#: The special tokens transformers renders a template with (`special_tokens_map`).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


def special_tokens(config: dict) -> dict:
    """The special tokens of a tokenizer_config.json as a chat template sees them: the named
    ones present (strings), and `additional_special_tokens` (a list) when given."""
    out = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [_token_text(t) for t in extra]
    return out


def _generation_extension():
    """transformers' `{% generation %}...{% endgeneration %}` tag (its assistant-token mask):
    rendered as its body; in a render whose context holds a `_GENERATION_TRACK` list, the body
    is also wrapped in the `_GENERATION_*` markers and counted there, so that the one rendering
    says where each block's text lands (`ChatTemplate.generation_segments`)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_block", [nodes.ContextReference()], lineno=lineno)
            return nodes.CallBlock(call, [], [], body, lineno=lineno)

        def _block(self, context, caller):
            text = caller()
            blocks = context.get(_GENERATION_TRACK)
            if not isinstance(blocks, list):
                return text
            blocks.append(len(text))
            return _GENERATION_BEGIN + text + _GENERATION_END

    return Generation


def _undefined_names(tree, env) -> list[tuple[str, str, int]]:
    """("filter" or "test", name, line) of each filter or test the template uses that
    `env` lacks. jinja2 refuses such a filter at compile time only outside a conditional, and a
    test never: inside one, the error waits for a conversation that takes the branch."""
    from jinja2 import nodes

    out = []
    for kind, node_type, known in (("filter", nodes.Filter, env.filters), ("test", nodes.Test, env.tests)):
        for node in tree.find_all(node_type):
            if node.name not in known:
                out.append((kind, node.name, node.lineno))
    return sorted(set(out), key=lambda x: (x[2], x[0], x[1]))


class ChatTemplate:
    """A jinja2 chat template, rendered in jinja2's sandbox with the context transformers'
    `apply_chat_template` gives it: `messages` (each turn with all its fields), `tools` and
    `documents` (None unless the sample gives them), `add_generation_prompt=False`, the special
    tokens (`bos_token`, `eos_token`, ...), `raise_exception` and `strftime_now`."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "",
                 specials: dict | None = None) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.name = name
        self.source = source
        # ChatML (the default) is cut into segments directly: the general cut renders every
        # prefix of the conversation, quadratic in its turns (~0.2 ms a 6-turn conversation,
        # 3x a reader's whole per-sample cost). Same text and mask (a test compares them).
        self.chatml = source == CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_extension()])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson  # as transformers renders it: not HTML-escaped
        # Compiling finds what parsing does not: a filter or test the environment lacks, refused
        # here as a syntax error is, before any sample is read (jinja2 defers one inside a
        # conditional to rendering, which refuses each sample it reaches as `chat_template`).
        try:
            tree = env.parse(source)
            self.template = env.from_string(tree)
        except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError (unknown filter) too
            raise ValueError(f"chat template {name!r} is not valid jinja2 (line {e.lineno}: {e.message})") from None
        for kind, undefined, line in _undefined_names(tree, env):  # compiled; fails when reached
            log.warning("mmdispatch event=chat_template_undefined template=%s %s=%s line=%d: "
                        "jinja2 and transformers define no %s %r, so every conversation that "
                        "reaches line %d is skipped (reason chat_template); fix the template or "
                        "choose another (--chat-template)", name or "-", kind, undefined, line,
                        kind, undefined, line)
        # A template that marks what the model generates is cut by its marks, not by its turns.
        self.generation = any(isinstance(block.call.node, jinja2.nodes.ExtensionAttribute)
                              and block.call.node.name == "_block"
                              for block in tree.find_all(jinja2.nodes.CallBlock))
        self.specials = {"bos_token": bos_token, "eos_token": eos_token, **(specials or {})}
        # The tokenizer's template named "tool_use", for conversations given `tools`
        # (`for_tools`); set by `resolve_chat_template`.
        self.tool_use: ChatTemplate | None = None
        self._skeletons: dict[tuple, list | None] = {}  # roles -> cut with marker contents

    @property
    def identity(self) -> str:
        """What makes this template's text: "chatml" for the built-in, else the SHA-256 (16 hex
        digits) of its source and the special tokens it is rendered with (and of its `tool_use`
        template's source, where it has one)."""
        if self.chatml and self.tool_use is None:
            return "chatml"
        fields = {"source": self.source, "specials": self.specials}
        if self.tool_use is not None:
            fields["tool_use"] = self.tool_use.source
        blob = json.dumps(fields, sort_keys=True)
        return "sha256:" + hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def for_tools(self, tools: list | None) -> ChatTemplate:
        """The template a conversation given `tools` is rendered with: the "tool_use" one where
        the tokenizer names one, as transformers' `get_chat_template` picks it whenever tools
        are passed (an empty list too); else this one."""
        return self.tool_use if tools is not None and self.tool_use is not None else self

    def render(self, messages: list[dict], tools: list | None = None,
               documents: list | None = None, **extra) -> str:
        """The conversation's text (`extra`: more context, such as `_GENERATION_TRACK`)."""
        import jinja2

        try:
            return self.template.render(messages=messages, tools=tools, documents=documents,
                                        add_generation_prompt=False, **self.specials, **extra)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"chat template {self.name!r} refuses the conversation: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template {self.name!r} fails: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # e.g. `tojson` of an object the sample gives: a refused sample, not a crashed reader
            raise ChatTemplateError(f"chat template {self.name!r} fails: {type(e).__name__}: {e}") from None

    def segments(self, messages: list[dict], trained: tuple[bool, ...] | None = None,
                 tools: list | None = None, documents: list | None = None) -> list[tuple[str, int]]:
        """The rendered conversation cut into (text, mask) pieces whose texts concatenate to
        `render(messages)`. An assistant turn is its header (mask 0), then its content and the
        template's end-of-turn text after it (mask 1), from the `<think>` tag that opens its
        reasoning where the rendering has one (reasoning in the content or in a
        `reasoning_content` field alike); every other piece has mask 0, as has an assistant turn
        whose `trained` entry is False (ShareGPT's per-turn weight 0).

        A template whose text for earlier turns changes once later turns follow (Qwen3 drops
        past reasoning, Mistral v0.3 moves the system text into the last user turn) cannot be
        cut turn by turn: it is rendered whole and each assistant content located in it
        (`aligned_segments`). A template that marks what the model generates with
        `{% generation %}` is cut by those marks alone (`generation_segments`)."""
        ctx = {"tools": tools, "documents": documents}
        if self.chatml:
            return _chatml_segments([_joined(t) for t in messages], trained)
        if self.generation:
            return self.generation_segments(messages, trained, **ctx)
        if tools is None and documents is None:
            cut = self._from_skeleton(messages, trained)
            if cut is not None:
                return cut
        try:
            return self.rendered_segments(messages, trained, **ctx)
        except ChatTemplateError as e:
            failed = e
        try:
            return self.aligned_segments(messages, trained, **ctx)
        except _NotAligned as e:
            raise ChatTemplateError(f"{failed}; rendered whole, {e}") from None

    def _from_skeleton(self, messages: list[dict], trained: tuple[bool, ...] | None = None
                       ) -> list[tuple[str, int]] | None:
        """`rendered_segments` in one render: the cut of a conversation with the same roles and
        a marker for each content (computed once per role sequence) with the contents put in,
        taken only if it renders exactly as the conversation does; else None. The general cut
        renders every prefix, quadratic in the turns (~0.13 ms for 6, ~0.8 ms for 20)."""
        if any(len(t) > 2 or not isinstance(t.get("content"), str) for t in messages):
            return None  # tool-use fields and content parts render per conversation
        roles = (tuple(t["role"] for t in messages), trained)
        skeleton = self._skeletons.get(roles, _UNCUT)
        if skeleton is _UNCUT:
            skeleton = self._skeleton(messages, trained)
            if len(self._skeletons) >= _MAX_SKELETONS:
                self._skeletons.clear()
            self._skeletons[roles] = skeleton
        if skeleton is None:
            return None
        rendered = self.render(messages)
        for contents in ([t["content"] for t in messages], [t["content"].strip() for t in messages]):
            out = [("".join(contents[p] if isinstance(p, int) else p for p in parts), mask)
                   for parts, mask in skeleton]
            if sum(len(t) for t, _ in out) == len(rendered) and "".join(t for t, _ in out) == rendered:
                return [(t, m) for t, m in out if t]
        return None

    def _skeleton(self, messages: list[dict], trained: tuple[bool, ...] | None
                  ) -> list[tuple[list, int]] | None:
        """The cut of `messages`' roles with marker contents, each piece as literal strings and
        turn indices (None: the template does not cut such a conversation)."""
        markers = [f"MMDISPATCHx{k}xTURNxMARKER" for k in range(len(messages))]
        try:
            cut = self.rendered_segments([{**t, "content": m} for t, m in zip(messages, markers)],
                                         trained)
        except ChatTemplateError:
            return None
        split = re.compile("(" + "|".join(map(re.escape, markers)) + ")")
        index = {m: k for k, m in enumerate(markers)}
        return [([index.get(p, p) for p in split.split(text) if p], mask) for text, mask in cut]

    def generation_segments(self, messages: list[dict], trained: tuple[bool, ...] | None = None,
                            tools: list | None = None, documents: list | None = None
                            ) -> list[tuple[str, int]]:
        """`segments` of a template that marks the text the model generates with `{% generation
        %}...{% endgeneration %}` (transformers' `return_assistant_tokens_mask`): a rendering
        with each block's text wrapped in markers that are then taken out, which must equal the
        plain rendering; mask 1 on exactly the blocks' text, 0 elsewhere. Where some assistant
        turn is untrained, the blocks must be one per assistant turn (the k-th block is the k-th
        assistant turn's), and an untrained turn's block has mask 0. ChatTemplateError when a
        text holds a marker, blocks nest or their output is not written where rendered, or is
        changed after (trimmed), or the blocks do not pair with the turns."""
        blocks: list[int] = []  # each rendered block's length, in rendering order
        raw = self.render(messages, tools, documents, **{_GENERATION_TRACK: blocks})
        pieces = re.split(f"({_GENERATION_BEGIN}|{_GENERATION_END})", raw)
        texts, marks = pieces[0::2], pieces[1::2]
        if (marks != [_GENERATION_BEGIN, _GENERATION_END] * len(blocks)
                or [len(t) for t in texts[1::2]] != blocks):
            raise ChatTemplateError(f"chat template {self.name!r}: cannot place its {{% generation %}} "
                                    f"blocks in the rendering exactly (a text holds {_GENERATION_BEGIN!r} "
                                    "or its end, or blocks nest or are not written out), so the mask "
                                    "would be a guess")
        turns = [k for k, t in enumerate(messages) if t["role"] == ASSISTANT]
        untrained: set[int] = set()  # blocks of untrained turns
        if trained is not None and not all(trained[k] for k in turns):
            if len(blocks) != len(turns):
                raise ChatTemplateError(f"chat template {self.name!r} renders {len(blocks)} {{% generation "
                                        f"%}} blocks for {len(turns)} assistant turns, so which block "
                                        "is the untrained (weight 0) turn's would be a guess")
            untrained = {b for b, k in enumerate(turns) if not trained[k]}
        out = [(texts[0], 0)]
        for b in range(len(blocks)):
            out += [(texts[2 * b + 1], int(b not in untrained)), (texts[2 * b + 2], 0)]
        # The markers shield a block's edges from what the template does to its output
        # afterwards (`{% set %}` it, then `| trim`): the text must be the plain rendering's.
        if "".join(texts) != self.render(messages, tools, documents):
            raise ChatTemplateError(f"chat template {self.name!r} changes the text of its {{% generation "
                                    "%}} blocks after rendering them (a trim or replace of their "
                                    "output), so the mask would be a guess")
        return [(t, m) for t, m in out if t]

    def rendered_segments(self, messages: list[dict], trained: tuple[bool, ...] | None = None,
                          tools: list | None = None, documents: list | None = None
                          ) -> list[tuple[str, int]]:
        """`segments` for any template: each turn's text is what rendering the conversation up
        to it adds, and an assistant turn's targets are located by rendering sentinels for its
        content and its `reasoning_content`: from the first sentinel (or the `<think>` tag just
        before the reasoning) to the turn's end."""
        out: list[tuple[str, int]] = []
        prev = ""
        for k, turn in enumerate(messages):
            full = self.render(messages[: k + 1], tools, documents)
            if not full.startswith(prev):
                raise ChatTemplateError(f"chat template {self.name!r} renders turn {k - 1} differently once "
                                        f"turn {k} follows: no exact per-turn mask exists")
            seg, before, prev = full[len(prev):], prev, full
            if turn["role"] != ASSISTANT or (trained is not None and not trained[k]):
                out.append((seg, 0))
                continue
            probe_turn = {**turn, "content": _SENTINEL}
            if _has_text(turn.get("reasoning_content")):
                probe_turn["reasoning_content"] = _REASONING_SENTINEL
            probe = self.render([*messages[:k], probe_turn], tools, documents)
            at = probe.find(_SENTINEL, len(before)) if probe.startswith(before) else -1
            think = probe.find(_REASONING_SENTINEL, len(before)) if at >= 0 else -1
            start, end = at, at + len(_SENTINEL)
            if think >= 0:
                start = min(start, _think_start(probe, think, len(before)))
                end = max(end, think + len(_REASONING_SENTINEL))
            head, tail = probe[len(before):start], probe[end:]
            if at < 0 or not (seg.startswith(head) and seg.endswith(tail) and len(head) + len(tail) <= len(seg)):
                raise ChatTemplateError(f"chat template {self.name!r}: cannot locate assistant turn "
                                        f"{k}'s content in its rendering, so its mask would be a guess")
            out += [(head, 0), (seg[len(head):], 1)]
        return [(t, m) for t, m in out if t]

    def aligned_segments(self, messages: list[dict], trained: tuple[bool, ...] | None = None,
                         tools: list | None = None, documents: list | None = None
                         ) -> list[tuple[str, int]]:
        """`segments` from one rendering of the whole conversation: the conversation is also
        rendered with each trained assistant turn's texts (its content, or its reasoning and
        answer when it holds `<think>...</think>`; each text part of a content list; its
        `reasoning_content`) replaced by markers, and the real rendering must equal that one
        with the marker texts put back (stripped of edge whitespace: templates trim); the
        marked texts, from a turn's first to its last, are its targets, from the `<think>` tag
        right before its reasoning where there is one, and with what the template writes after
        the last one when the turn ends the conversation (its tool calls, its end of turn),
        where exactly that text follows. An assistant turn of tool calls alone is its tool-call
        text, located between its located neighbours: once there, or as many times as there
        are such turns with that same text, which then take the occurrences in order (a
        repeated call); reasoning may be left out (Qwen3 drops past reasoning), any other
        text may not. `_NotAligned` when no such cut exists."""
        rendered = self.render(messages, tools, documents)
        marked = list(messages)
        marks: dict[int, list[tuple[str, str, str, str]]] = {}  # turn -> (marker, text, edge spaces)
        for k, turn in enumerate(messages):
            if turn["role"] != ASSISTANT or (trained is not None and not trained[k]):
                continue
            marked[k], marks[k] = _marked_turn(turn, k)
        skeleton = self.render(marked, tools, documents)
        names = {m: (k, text, left) for k, found in marks.items() for m, text, left, _ in found}
        pieces = re.split("(" + "|".join(map(re.escape, names)) + ")", skeleton) if names else [skeleton]
        spans: dict[int, list[int]] = {}  # turn -> [start, end) of its marked texts in `rendered`
        last: dict[int, str] = {}  # turn -> the marker it ends with in the rendering
        at = 0
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if not rendered.startswith(piece, at):
                    raise _NotAligned(f"cannot locate every assistant content exactly (the rendering "
                                      f"departs from the one with markers at character {at})")
                at += len(piece)
                continue
            k, text, left = names[piece]
            if not rendered.startswith(text, at):
                raise _NotAligned(f"cannot locate assistant turn {k}'s content (as rendered)")
            start = at - len(left) if left and rendered.startswith(left, at - len(left)) else at
            if k not in spans and piece.endswith("xREASONING"):
                start = _think_start(rendered, start, at - len(pieces[i - 1]))
            spans[k] = [min(spans.get(k, [start])[0], start), at + len(text)]
            last[k] = piece
            at += len(text)
        if at != len(rendered):
            raise _NotAligned("the rendering is longer than its parts")
        seen = pieces[1::2]
        if len(seen) != len(set(seen)):
            raise _NotAligned("the template renders an assistant content twice")
        for k, found in marks.items():
            main = [m for m, _, _, _ in found if not m.endswith("xREASONING")]  # may be dropped
            if any(m not in seen for m in main):
                raise _NotAligned(f"the template leaves out assistant turn {k}'s content")
        calls: dict[int, str] = {}  # turn of tool calls alone -> its tool-call text
        for k in marks:
            if k not in spans and messages[k].get("tool_calls"):
                calls[k] = self._turn_tail(messages, k, {**messages[k], "content": _SENTINEL},
                                           _SENTINEL, tools, documents)
        cuts: list[tuple[int, int]] = []
        cursor = 0
        placed: dict[int, int] = {}  # turn of tool calls alone -> where its text starts
        for k in sorted(marks):
            if k in spans:
                start, end = spans[k]
                after = self._turn_tail(messages, k, marked[k], last[k], tools, documents)
                if after and rendered.startswith(after, end):
                    end += len(after)
            elif calls.get(k):
                if k not in placed:
                    # The turns of tool calls alone before the next located turn take their
                    # texts' occurrences there in order, where only one such placement exists:
                    # a repeated call (a retry, a poll), one inside a later parallel call. Two
                    # placements mean one may be a quote (in a tool result, a user turn), and
                    # which is the call would be a guess.
                    later = min((j for j in spans if j > k), default=None)
                    bound = len(rendered) if later is None else spans[later][0]
                    group = [j for j in sorted(calls) if k <= j and (later is None or j < later)
                             and calls[j]]
                    at = _unique_placement(rendered, [calls[j] for j in group], cursor, bound)
                    if at is None:
                        raise _NotAligned(f"cannot locate assistant turn {k}'s tool calls once (no "
                                          "placement, or more than one, of the tool-call turns "
                                          "before the next reply)")
                    placed.update(zip(group, at))
                start = placed[k]
                end = start + len(calls[k])
            else:
                raise _NotAligned(f"assistant turn {k} has no content to locate")
            if start < cursor:
                raise _NotAligned(f"assistant turn {k}'s text overlaps the turn before it")
            cuts.append((start, end))
            cursor = end
        out: list[tuple[str, int]] = []
        at = 0
        for start, end in cuts:
            out += [(rendered[at:start], 0), (rendered[start:end], 1)]
            at = end
        out.append((rendered[at:], 0))
        return [(t, m) for t, m in out if t]

    def _turn_tail(self, messages: list[dict], k: int, turn: dict, marker: str, tools: list | None,
                   documents: list | None) -> str:
        """What the template writes after `marker` in `turn` (assistant turn `k`, with `marker`
        in its texts) when that turn ends the conversation (the rest of its texts, its tool
        calls, its end-of-turn text); "" if that rendering fails."""
        try:
            probe = self.render([*messages[:k], turn], tools, documents)
        except ChatTemplateError:
            return ""
        at = probe.rfind(marker)
        return probe[at + len(marker):] if at >= 0 else ""


class _NotAligned(Exception):
    """A conversation whose whole rendering cannot be cut into turns exactly (why, in words)."""


def _has_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _think_start(text: str, at: int, floor: int) -> int:
    """Where reasoning starting at `at` in `text` is trained from: the `<think>` tag right
    before it (whitespace between), where there is one after `floor`; else `at`."""
    tag = len(text[floor:at].rstrip()) + floor - len(_THINK)
    return tag if tag >= floor and text.startswith(_THINK, tag) else at


def _occurrences(text: str, sub: str, start: int, end: int) -> list[int]:
    """Where `sub` occurs in `text[start:end]`, overlapping occurrences included."""
    found, at = [], text.find(sub, start, end)
    while at >= 0:
        found.append(at)
        at = text.find(sub, at + 1, end)
    return found


def _unique_placement(text: str, needles: list[str], start: int, end: int) -> list[int] | None:
    """Where each of `needles` starts in `text[start:end]`, in order, each after the one before
    ends: the only such placement; None where there is none or more than one."""
    occ = [_occurrences(text, n, start, end) for n in needles]
    # ways[i][j]: placements (counted to 2) of needles i.. with needle i at occ[i][j]
    ways: list[list[int]] = [[] for _ in needles]
    for i in reversed(range(len(needles))):
        for p in occ[i]:
            if i == len(needles) - 1:
                ways[i].append(1)
            else:
                follow = p + len(needles[i])
                ways[i].append(min(2, sum(w for q, w in zip(occ[i + 1], ways[i + 1]) if q >= follow)))
    if not needles or sum(ways[0]) != 1:
        return None if needles else []
    out, at = [], start
    for i in range(len(needles)):
        p = next(p for p, w in zip(occ[i], ways[i]) if p >= at and w)
        out.append(p)
        at = p + len(needles[i])
    return out


def _mark(text: str, k: int, part: str, found: list[tuple[str, str, str, str]]) -> str:
    """`text` with its core replaced by a marker that keeps its edge whitespace, recorded in
    `found` as (marker, core, left and right whitespace); a blank text as it is."""
    core = text.strip()
    if not core:
        return text
    left = text[: len(text) - len(text.lstrip())]
    right = text[len(left) + len(core):]
    marker = f"MMDISPATCHx{k}x{len(found)}x{part}"
    found.append((marker, core, left, right))
    return left + marker + right


def _marked_turn(turn: dict, k: int) -> tuple[dict, list[tuple[str, str, str, str]]]:
    """Assistant turn `k` with its texts to locate marked (`_mark`), and what was marked: its
    `reasoning_content` (Qwen3's, DeepSeek-R1's), then its content: a string's text, or its
    reasoning and answer around `</think>`, or each text part of a content list."""
    found: list[tuple[str, str, str, str]] = []
    out = dict(turn)
    if isinstance(turn.get("reasoning_content"), str):
        out["reasoning_content"] = _mark(turn["reasoning_content"], k, "REASONING", found)
    content = turn.get("content")
    if isinstance(content, str):
        end = content.rfind("</think>")
        begin = content.rfind(_THINK, 0, end) if end >= 0 else -1
        if begin >= 0:
            head = content[: begin + len(_THINK)]
            reasoning = _mark(content[len(head):end], k, "REASONING", found)
            out["content"] = head + reasoning + "</think>" + _mark(content[end + len("</think>"):], k,
                                                                  "ANSWER", found)
        else:
            out["content"] = _mark(content, k, "CONTENT", found)
    elif isinstance(content, list):
        out["content"] = [{**p, "text": _mark(p["text"], k, "PART", found)}
                          if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                          else p for p in content]
    return out, found


def _joined(turn: dict) -> dict:
    """`turn` with a content list (OpenAI-style parts) as its text parts joined: what the
    built-in ChatML template, which concatenates content as a string, renders."""
    content = turn.get("content")
    if isinstance(content, list):
        return {**turn, "content": "".join(p["text"] for p in content if isinstance(p, dict)
                                           and isinstance(p.get("text"), str))}
    return turn


def _chatml_segments(messages: list[dict], trained: tuple[bool, ...] | None = None
                     ) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for k, turn in enumerate(messages):
        role, content = turn["role"], turn["content"]
        if role == ASSISTANT and (trained is None or trained[k]):
            out += [(f"<|im_start|>{role}\n", 0), (f"{content}<|im_end|>\n", 1)]
        else:
            out.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", 0))
    return out


#: Tokenizers already warned of falling back to ChatML (once each per process).
_FALLBACK_WARNED: set[str] = set()


def resolve_chat_template(spec: str | None, tokenizer_path: str | None) -> ChatTemplate:
    """The chat template to use: `spec` (the name of one of the tokenizer's own named templates,
    a built-in name, a tokenizer_config.json or a jinja file), else the tokenizer's default
    template (`_own_templates`: chat_template.jinja beside it, which newer transformers saves
    and reads first, else the `chat_template` of its tokenizer_config.json), else ChatML (with a
    warning when a tokenizer was given: its model may expect another format). A name the
    tokenizer gives one of its templates wins over the built-in of that name: transformers'
    `apply_chat_template(chat_template=NAME)` renders the tokenizer's. With named templates,
    "tool_use" is the template's `tool_use` (`ChatTemplate.for_tools`). The special tokens come
    from the tokenizer_config.json. ValueError, naming the value and the fix, when `spec` is
    none of these."""
    beside, config = _config_beside(tokenizer_path)
    own = _own_templates(beside, config)
    tool_use = None  # the tokenizer's template named "tool_use", for conversations given tools
    if spec is None:
        if own.default is not None or own.named or config.get("chat_template"):
            source, name = _default_of(own), own.default_name
            tool_use = own.named.get("tool_use")
        else:
            source, name = CHATML, "chatml"
            if tokenizer_path is not None:
                name = "chatml (fallback)"
                if tokenizer_path not in _FALLBACK_WARNED:
                    _FALLBACK_WARNED.add(tokenizer_path)
                    log.warning("mmdispatch event=chat_template_fallback tokenizer=%s: no chat "
                                "template beside it (chat_template.jinja, or chat_template in "
                                "tokenizer_config.json); conversations are rendered as ChatML, "
                                "which transformers would refuse (\"chat_template is not set\"): "
                                "pass --chat-template if the model expects another format",
                                tokenizer_path)
    elif spec in own.named:  # as apply_chat_template(chat_template=NAME): always it
        source, name = own.named[spec], own.names[spec]
    elif spec in BUILTIN_TEMPLATES:
        source, name = BUILTIN_TEMPLATES[spec], spec
    elif os.path.isfile(spec):
        if spec.endswith(".json"):
            config = _read_config(spec)
            given = _own_templates(spec, config)
            source, name = _default_of(given), given.default_name
            tool_use = given.named.get("tool_use")
        else:
            source, name = _read_jinja(spec), spec
    else:
        raise ValueError(_unknown_template(spec, own))
    specials = special_tokens(config)
    template = ChatTemplate(source, name=name, specials=specials)
    if tool_use is not None:
        template.tool_use = ChatTemplate(tool_use, name=f"{name} (tool_use)", specials=specials)
    return template


def check_chat_template(spec: str | None, tokenizer_path: str | None) -> None:
    """ValueError in one line, naming `spec`, the names it may take and the fix, unless it is
    unset, the name of one of the tokenizer's own named templates (`_own_templates`), a
    built-in name or a file. Checked at start (`TextConfig`): a reader would otherwise fail
    only once a shard arrives."""
    if spec is None or spec in BUILTIN_TEMPLATES or os.path.isfile(spec):
        return
    own = _own_templates(*_config_beside(tokenizer_path))
    if spec not in own.named:
        raise ValueError(_unknown_template(spec, own))


def _unknown_template(spec: str, own: _OwnTemplates) -> str:
    """Why `spec` names no chat template, with the names it may take (the tokenizer's own)."""
    listed = f", nor one of the templates {own.where!r} names ({', '.join(own.named)})," if own.named else ""
    return (f"chat template {spec!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}){listed} "
            f"nor a file: pass a name, a .jinja file or a tokenizer_config.json")


def chat_template_identity(spec: str | None, tokenizer_path: str | None) -> dict[str, str]:
    """`{"chat_template": ...}`: the identity (`ChatTemplate.identity`) of the template
    `resolve_chat_template` picks, so data nodes rendering conversations differently are
    refused as a tokenizer mismatch is."""
    return {"chat_template": resolve_chat_template(spec, tokenizer_path).identity}


def _read_jinja(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise ValueError(f"chat template {path!r} cannot be read as UTF-8 text ({e})") from None


def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer config {path!r} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"tokenizer config {path!r} holds a JSON {type(config).__name__}, expected an object")
    return config


def _config_beside(tokenizer_path: str | None) -> tuple[str | None, dict]:
    """(the path of the tokenizer_config.json beside the tokenizer file, or None without a
    tokenizer; that config, or {} where there is none)."""
    if not tokenizer_path:
        return None, {}
    beside = os.path.join(os.path.dirname(tokenizer_path), "tokenizer_config.json")
    return beside, (_read_config(beside) if os.path.isfile(beside) else {})


def _named_templates(config: dict) -> dict[str, str]:
    """A tokenizer config's list of named chat templates ({name, template} each), as
    transformers reads it: name -> template; {} where `chat_template` is no list."""
    value = config.get("chat_template")
    if not isinstance(value, list):
        return {}
    return {t["name"]: t["template"] for t in value
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}


@dataclass(frozen=True, slots=True)
class _OwnTemplates:
    """The chat templates a tokenizer's folder holds, as transformers loads them."""

    where: str | None  # what messages name: the config, or the folder where files name templates
    default: str | None  # rendered when no template is named; None: the folder has none
    default_name: str | None  # the file (or config) `default` was read from
    named: dict[str, str]  # name -> template, for `--chat-template NAME`, "default", "tool_use"
    names: dict[str, str]  # name -> the template's own name: its file, or "CONFIG (NAME)"


def _own_templates(config_path: str | None, config: dict) -> _OwnTemplates:
    """The chat templates of the tokenizer whose tokenizer_config.json is `config_path` (it
    need not exist) and holds `config`. Newer transformers saves them as files beside it and
    reads those first: chat_template.jinja replaces the config's `chat_template` (a string or
    a list), and each additional_chat_templates/NAME.jinja adds a template NAME beside it, the
    former being "default" then. A config's list form names its templates the same way, so a
    tokenizer saved either way is read alike."""
    if config_path is None:
        return _OwnTemplates(None, None, None, {}, {})
    folder = os.path.dirname(config_path)
    jinja = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        named, names = {}, {}
        default, default_name = _read_jinja(jinja), jinja
    else:
        value = config.get("chat_template")
        named = _named_templates(config)
        names = {n: f"{config_path} ({n})" for n in named}
        default = value if isinstance(value, str) and value else named.get("default")
        default_name = config_path
    extra = _additional_templates(folder)
    where = folder if extra else config_path
    if extra:
        if default is not None:
            named.setdefault("default", default)
            names.setdefault("default", default_name)
        for name, path in extra.items():
            named[name], names[name] = _read_jinja(path), path
    if named:
        default = named.get("default")
        default_name = names.get("default", default_name)
    return _OwnTemplates(where, default, default_name, named, names)


def _additional_templates(folder: str) -> dict[str, str]:
    """name -> path of each additional_chat_templates/NAME.jinja in `folder`, by name."""
    directory = os.path.join(folder, TEMPLATE_DIR)
    if not os.path.isdir(directory):
        return {}
    return {entry.removesuffix(".jinja"): os.path.join(directory, entry)
            for entry in sorted(os.listdir(directory))
            if entry.endswith(".jinja") and os.path.isfile(os.path.join(directory, entry))}


def _default_of(own: _OwnTemplates) -> str:
    """The template a tokenizer renders when none is named: `own.default`, else ValueError
    naming where it looked and the fix (transformers refuses these as well)."""
    if own.default is not None:
        return own.default
    what = "tokenizer config" if str(own.where).endswith(".json") else "tokenizer folder"
    if own.named:  # transformers: "multiple chat templates with no default"
        raise ValueError(f"{what} {own.where!r} names chat templates {', '.join(own.named)} but none "
                         f"'default': pass --chat-template with one of these names, a built-in "
                         f"({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file")
    raise ValueError(f"{what} {own.where!r} has no chat_template string: pass --chat-template "
                     f"with a name ({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file")


class TextEncoder:
    """Plain text and conversations -> `TextTokens`, under one tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer, self.template = tokenizer, template
        self._untrained_warned = False  # a conversation with no assistant turn was seen

    @staticmethod
    def load(tokenizer_path: str | None, chat_template: str | None = None) -> TextEncoder:
        return TextEncoder(load_tokenizer(tokenizer_path), resolve_chat_template(chat_template, tokenizer_path))

    def token_id(self, token: str, flag: str) -> int:
        """The id of `token` where it is an added (or special) token of the tokenizer, as a
        placeholder must be: one ordinary text never forms (a vocabulary word such as 'What'
        would turn every 'What' that starts a text into an item's slot). Else ValueError in one
        line naming the token, flag and tokenizer."""
        tok = self.tokenizer
        ids = tok.encode(token).tolist()
        if isinstance(tok, ByteTokenizer):
            raise ValueError(f"{flag} {token!r} is not a token of the byte-level tokenizer (every "
                             "character is its UTF-8 bytes): pass --tokenizer with one that holds "
                             "the placeholder as an added token")
        added = {t.content: i for i, t in tok.tokenizer.get_added_tokens_decoder().items()}
        if added.get(token) is not None and ids == [added[token]]:
            return ids[0]
        raise ValueError(f"{flag} {token!r} is not an added or special token of tokenizer "
                         f"{tok.name!r} (it encodes to {len(ids)} ids {ids[:8]}): a placeholder must be "
                         "one that ordinary text never forms; add it to the tokenizer's added_tokens, "
                         "or name the token the model's processor expands, such as '<image>' or "
                         "'<|image_pad|>'")

    def plain(self, text: str) -> TextTokens:
        """Plain text: all tokens are targets (mask 1)."""
        return TextTokens.plain(self.tokenizer.encode(text))

    def conversation(self, turns: list[dict], tools: list | None = None,
                     documents: list | None = None, *, where: dict | None = None) -> TextTokens:
        """Turns of {"role", "content", ...} (and the sample's `tools` and `documents`) rendered
        through the chat template and tokenized whole, as the model sees the conversation at
        inference (`apply_chat_template`); mask 1 on
        exactly the tokens that cover assistant text (see `ChatTemplate.segments`).
        ChatTemplateError if the template fails; no turns are no tokens.

        Tokenizing the pieces one by one would not give the same ids: a SentencePiece-style
        tokenizer (Llama 2, Mistral, Gemma) starts every piece with a word boundary, and a merge
        can cross where two pieces meet. A token that straddles an assistant piece's edge is
        masked 1, as transformers' assistant-token mask does. `where`: the sample's shard and
        key, for the line that says (once) a conversation has no turn to train on."""
        if not turns:  # no text, under every template alike (one may index messages[0])
            return TextTokens.empty()
        trained = None
        if any("weight" in t for t in turns):  # ShareGPT's per-turn weight: 0 trains not on it
            trained = tuple(t.get("weight", 1) > 0 for t in turns)
            turns = [{k: v for k, v in t.items() if k != "weight"} for t in turns]
        segments = self.template.for_tools(tools).segments(turns, trained, tools, documents)
        if not segments:
            return TextTokens.empty()
        marks = np.array([m for _, m in segments], np.uint8)
        if all(t["role"] != ASSISTANT for t in turns) and not self._untrained_warned:
            self._untrained_warned = True  # once: a dataset's roles are the same throughout
            aliases = ", ".join(k for k, v in ROLE_ALIASES.items() if v == ASSISTANT)
            where = {k: redact(str(v)) if k == "shard" else v for k, v in (where or {}).items()}
            log.warning("%s", event_line(
                "conversation_without_targets", **where,
                roles=",".join(sorted({t["role"] for t in turns})),
                why=f"no turn is an {ASSISTANT!r} one (or {aliases}), so the sample trains on no "
                    "token; said for the first such sample",
                fix=f"name the reply role {ASSISTANT!r} in the data"))
        if isinstance(self.tokenizer, ByteTokenizer):  # one id per byte: nothing merges
            raw = [t.encode("utf-8") for t, _ in segments]
            ids = np.frombuffer(b"".join(raw), dtype=np.uint8).astype(np.int32)
            return TextTokens(ids, np.repeat(marks, [len(r) for r in raw]))
        text = "".join(t for t, _ in segments)
        ids, spans = self.tokenizer.encode_with_offsets(text)
        # Assistant characters counted up to each position; a token is a target when its span
        # holds any (an empty span, e.g. a prepended word boundary: the character it stands at).
        marked = np.zeros(len(text) + 1, np.int64)
        np.cumsum(np.repeat(marks, [len(t) for t, _ in segments]), out=marked[1:])
        starts = np.minimum(spans[:, 0], max(len(text) - 1, 0))
        ends = np.clip(spans[:, 1], starts + 1, len(text))
        return TextTokens(ids, (marked[ends] > marked[starts]).astype(np.uint8))


def normalize_turn(turn: dict) -> tuple[str | None, object]:
    """(role, content) of a {role|from, content|value} turn: the role lower-cased, and
    ShareGPT's and Gemini's names mapped to the chat-template roles (`ROLE_ALIASES`)."""
    role = turn.get("role", turn.get("from"))
    if isinstance(role, str):
        role = role.strip().lower()
        role = ROLE_ALIASES.get(role, role)
    else:
        role = None
    return role, turn.get("content", turn.get("value"))


__all__ = [
    "ASSISTANT", "BUILTIN_TEMPLATES", "BYTE_VOCAB_SIZE", "ByteTokenizer", "CHATML", "ChatTemplate",
    "ChatTemplateError", "HFTokenizer", "SPECIAL_TOKENS", "TextEncoder", "TextTokens", "Tokenizer",
    "chat_template_identity", "check_chat_template", "load_tokenizer", "normalize_turn",
    "resolve_chat_template",
]
