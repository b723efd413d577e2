"""Text as token ids: tokenizers, chat templates and loss masks, and ids delivered verbatim."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from dispatcher_server import protocol as P
from pipeline.counting import CountError, Counter, CountingConfig, TextConfig
from pipeline.gendata import TOKENIZER_VOCAB_SIZE, generate, write_tokenizer
from pipeline.inspect import collect
from pipeline.reader import ReaderConfig, iter_samples, iter_shard
from pipeline.tokenize import (
    CHATML, ByteTokenizer, ChatTemplate, ChatTemplateError, HFTokenizer, TextEncoder, TextTokens,
    load_tokenizer, resolve_chat_template,
)

tokenizers = pytest.importorskip("tokenizers")

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is a shard?"},
    {"role": "assistant", "content": "a tar file of samples."},
    {"role": "user", "content": "and a tokenizer? 東京"},
    {"role": "assistant", "content": "it turns text into ids: café"},
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[list[str], str]:
    """Generated shards and the BPE tokenizer gen-data trains on them."""
    out = tmp_path_factory.mktemp("tok")
    shards = generate(str(out), num_samples=40, num_shards=2, seed=5)
    return shards, write_tokenizer(str(out), shards)


def _assistant_text(turns: list[dict]) -> str:
    return "".join(t["content"] + "<|im_end|>\n" for t in turns if t["role"] == "assistant")


def test_byte_tokenizer_round_trips_exactly():
    tok = ByteTokenizer()
    for text in ("", "plain ascii", "café naïve 東京 数据 모델 🙂", "tab\tnew\nline\0nul"):
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
        assert ids.max(initial=0) < tok.vocab_size == 256
        assert tok.decode(ids) == text
    plain = TextEncoder(tok, resolve_chat_template(None, None)).plain("abc")
    assert plain.ids.tolist() == [97, 98, 99] and plain.mask.tolist() == [1, 1, 1]


def test_hf_tokenizer_ids_equal_the_library_encode(data):
    _, path = data
    hf = tokenizers.Tokenizer.from_file(path)
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == TOKENIZER_VOCAB_SIZE
    for text in ("the dispatcher balances a shard of samples", "café 東京 <|im_start|>user\nhi<|im_end|>", ""):
        assert tok.encode(text).tolist() == hf.encode(text, add_special_tokens=False).ids
    # The chat markers are single special tokens, not split into bytes.
    assert tok.encode("<|im_start|>").tolist() == [hf.token_to_id("<|im_start|>")]


def test_a_tokenizer_saved_with_truncation_or_padding_encodes_every_text_whole(data, tmp_path):
    """Probe: a tokenizer.json saved with truncation (or padding) on cut every text to 16 ids
    (or padded it with trained pad ids) where the model's tokenizer turns both off."""
    _, path = data
    text = " ".join(["the dispatcher balances a shard of samples"] * 20)
    whole = tokenizers.Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids
    plain = tokenizers.Tokenizer.from_file(path)
    for name, setting, saved_len in (("truncating", lambda t: t.enable_truncation(max_length=16), 16),
                                     ("padding", lambda t: t.enable_padding(length=1024, pad_id=0), 1024)):
        saved = tokenizers.Tokenizer.from_file(path)
        setting(saved)
        saved.save(str(tmp_path / f"{name}.json"))
        assert len(tokenizers.Tokenizer.from_file(str(tmp_path / f"{name}.json")).encode(text).ids) == saved_len
        tok = load_tokenizer(str(tmp_path / f"{name}.json"))
        assert tok.encode(text).tolist() == whole and 16 < len(whole) < 1024, name
        assert tok.encode("short").tolist() == plain.encode("short", add_special_tokens=False).ids, name
        assert tok.encode_with_offsets(text)[0].tolist() == whole, name


def test_one_tokenizer_saved_again_is_the_same_tokenizer_and_another_is_not(data, tmp_path):
    """Probe: the same tokenizer re-saved (indented otherwise, keys in another order, its
    truncation on) was refused as other rules; the identity is of the JSON, not its bytes."""
    from pipeline.tokenize import tokenizer_identity

    _, path = data
    obj = json.loads(open(path, encoding="utf-8").read())
    (tmp_path / "indented.json").write_text(json.dumps(obj, indent=1, ensure_ascii=True))
    (tmp_path / "reordered.json").write_text(json.dumps(dict(reversed(list(obj.items())))))
    (tmp_path / "truncating.json").write_text(json.dumps({**obj, "truncation": {"max_length": 16}}))
    vocab = obj["model"]["vocab"]
    first = next(iter(vocab))
    other = {**obj, "model": {**obj["model"], "vocab": {**vocab, first: vocab[first] + 10**6}}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    ours = tokenizer_identity(path)
    for same in ("indented.json", "reordered.json", "truncating.json"):
        assert tokenizer_identity(str(tmp_path / same)) == ours, same
    assert tokenizer_identity(str(tmp_path / "other.json")) != ours


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_chat_template_renders_and_masks_exactly_the_assistant_tokens(data, which):
    path = None if which == "bytes" else data[1]
    enc = TextEncoder.load(path)  # bpe: the template comes from the tokenizer_config.json beside it
    got = enc.conversation(CONVERSATION)
    rendered = ChatTemplate(CHATML).render(CONVERSATION)
    assert got.ids.dtype == np.int32 and got.mask.dtype == np.uint8 and len(got.ids) == len(got.mask)
    targets = got.ids[got.mask == 1]
    if which == "bytes":
        assert ByteTokenizer.decode(got.ids) == rendered
        assert ByteTokenizer.decode(targets) == _assistant_text(CONVERSATION)
    else:
        hf = tokenizers.Tokenizer.from_file(path)
        assert hf.decode(got.ids.tolist(), skip_special_tokens=False) == rendered
        want = [i for t in CONVERSATION if t["role"] == "assistant"
                for i in hf.encode(t["content"] + "<|im_end|>\n", add_special_tokens=False).ids]
        assert targets.tolist() == want
    # Every masked-out token belongs to a system/user turn or an assistant header.
    assert 0 < int(got.mask.sum()) < len(got.mask)


def test_custom_template_file_with_special_tokens(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
                "{% else %}{{ raise_exception('roles must be user or assistant') }}{% endif %}{% endfor %}")
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    enc = TextEncoder.load(None, str(cfg))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    got = enc.conversation(turns)
    assert ByteTokenizer.decode(got.ids) == "<s>[INST] hi [/INST]hello</s>"
    assert ByteTokenizer.decode(got.ids[got.mask == 1]) == "hello</s>"
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant"):
        enc.conversation([{"role": "system", "content": "x"}])
    # A refused conversation is a bad sample (its own reason), not a crashed reader.
    counter = Counter(CountingConfig(text=TextConfig(chat_template=str(cfg))))
    with pytest.raises(CountError) as err:
        counter.text(json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(), "json", "m")
    assert err.value.reason == "chat_template"


def test_template_that_rewrites_earlier_turns_has_no_exact_mask(tmp_path):
    # Renders earlier turns differently once another turn follows (as templates that drop past
    # reasoning do): no per-turn cut exists. Rendered whole, an assistant content that the
    # template cut short (here: to its first character) cannot be located, so it is refused;
    # one rendered whole (the last turn) is located and trained on.
    jinja = tmp_path / "odd.jinja"
    jinja.write_text("{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}"
                     "{{ m['content'][:1] }}{% endif %}|{% endfor %}")
    enc = TextEncoder.load(None, str(jinja))
    with pytest.raises(ChatTemplateError, match="renders turn 0 differently.*cannot locate"):
        enc.conversation(CONVERSATION[1:4])
    got = enc.conversation(CONVERSATION[1:3])
    assert ByteTokenizer.decode(got.ids) == "w|a tar file of samples.|"
    assert ByteTokenizer.decode(got.ids[got.mask == 1]) == "a tar file of samples.|"


def test_bad_template_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in"):
        TextConfig(chat_template="llama9")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not valid jinja2"):
        resolve_chat_template(str(broken), None)
    no_template = tmp_path / "tokenizer_config.json"
    no_template.write_text("{}")
    with pytest.raises(ValueError, match="no chat_template"):
        resolve_chat_template(str(no_template), None)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ValueError, match="is a directory: pass"):
        load_tokenizer(str(model))
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is a directory \(pass '.*/model/tokenizer.json', the file"):
        load_tokenizer(str(model))


def test_wire_form_round_trips():
    tokens = TextTokens(np.array([0, 511, 2**31 - 1], np.int32), np.array([1, 0, 1], np.uint8))
    wire = tokens.to_wire()  # the narrowest width that holds the largest id: 4 bytes here
    assert len(wire) == 1 + 12 + 1 and wire[0] == 4 and wire[1:5] == bytes(4) and wire[13:] == b"\x05"
    back = TextTokens.from_wire(wire, 3)
    assert back.ids.tolist() == tokens.ids.tolist() and back.mask.tolist() == tokens.mask.tolist()
    # Byte-level ids take one byte each, ids under 65,536 two; the mask one bit a token.
    for top, width in ((255, 1), (256, 2), (65535, 2), (65536, 4)):
        ids = np.arange(17, dtype=np.int32) * 0 + top
        mask = (np.arange(17) % 3 == 0).astype(np.uint8)
        w = TextTokens(ids, mask).to_wire()
        assert w[0] == width and len(w) == P.tokens_size(17, width) == 1 + 17 * width + 3
        back = TextTokens.from_wire(w, 17)
        assert back.ids.tolist() == ids.tolist() and back.mask.tolist() == mask.tolist()
    assert TextTokens.empty().to_wire() == b"" and len(TextTokens.from_wire(b"", 0)) == 0
    for bad, n in ((wire, 4), (b"\x03" + wire[1:], 3), (wire[:-1], 3), (b"", 1), (b"\x01", 0)):
        assert not P.tokens_ok(bad, n)
        with pytest.raises(ValueError, match="wire form"):
            TextTokens.from_wire(bad, n)


def test_reader_samples_carry_exactly_text_len_ids(data):
    shards, path = data
    config = ReaderConfig(counting=CountingConfig(text=TextConfig(tokenizer_path=path)))
    hf = tokenizers.Tokenizer.from_file(path)
    records = [r for s in shards for r in iter_shard(s, config)]
    assert len(records) == 40
    plain = conversations = 0
    for rec in records:
        assert len(rec.tokens.ids) == len(rec.tokens.mask) == rec.text_len > 0
        assert rec.llm_len == rec.text_len + sum(it.llm_len for it in rec.items)
        assert int(rec.tokens.ids.max()) < TOKENIZER_VOCAB_SIZE
        text = next((bytes(rec.members[s]) for s in ("txt",) if s in rec.members), None)
        if text is not None:  # a plain caption: the library's ids, all targets
            assert rec.tokens.ids.tolist() == hf.encode(text.decode(), add_special_tokens=False).ids
            assert rec.tokens.mask.all()
            plain += 1
        elif "json" in rec.members:
            assert 0 < rec.tokens.mask.sum() < rec.text_len  # user turns are not targets
            conversations += 1
    assert plain and conversations


def test_inspect_counts_exactly_unless_asked_to_estimate(data):
    shards, _ = data
    exact = collect(shards, ReaderConfig(keep_members=False), show_progress=False)
    quick = collect(shards, ReaderConfig(counting=CountingConfig(text=TextConfig(estimate=True)),
                                         keep_members=False), show_progress=False)
    want = sum(r.text_len for r in iter_samples(shards))
    assert exact["modalities"]["text"]["llm_len"]["sum"] == want
    assert exact["modalities"]["text"]["counted_by"]["exact"] is True
    assert quick["modalities"]["text"]["counted_by"] == {
        "exact": False, "how": quick["modalities"]["text"]["counted_by"]["how"]}
    assert "approximate" in quick["modalities"]["text"]["counted_by"]["how"]
    assert quick["modalities"]["text"]["llm_len"]["sum"] != want  # bytes are not BPE-sized tokens


def test_gen_data_tokenizer_is_deterministic(data, tmp_path):
    shards, path = data
    again = write_tokenizer(str(tmp_path), shards)
    assert open(again, "rb").read() == open(path, "rb").read()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML


def test_trainer_receives_the_readers_ids_verbatim_through_the_dispatcher(data):
    torch = pytest.importorskip("torch")
    from tests.test_service import consume, dispatcher, make_config, readers

    shards, path = data
    reader = ReaderConfig(counting=CountingConfig(text=TextConfig(tokenizer_path=path)))
    want = {r.key: (r.tokens.ids.tolist(), r.tokens.mask.astype(bool).tolist()) for r in iter_samples(shards, reader)}

    def record(step):
        out = []
        for mb in step.microbatches:
            # The tensors have exactly the planned length, per sample.
            assert [t.numel() for t in mb.text_ids] == [m.numel() for m in mb.loss_mask] == mb.text_len.tolist()
            assert all(t.dtype == torch.int32 for t in mb.text_ids)
            assert all(m.dtype == torch.bool for m in mb.loss_mask)
            out += [(k, t.tolist(), m.tolist()) for k, t, m in zip(mb.keys, mb.text_ids, mb.loss_mask)]
        return out

    with dispatcher(make_config(shards, world_size=2, global_batch=8, max_epochs=1)) as srv, \
            readers(srv.reader_endpoint, 2, reader=reader):
        got = consume(srv.trainer_endpoint, 2, record=record)
    delivered = [s for steps in got.values() for step in steps for s in step]
    assert len(delivered) == 40  # five full steps of 8: the whole epoch
    assert {k: (ids, mask) for k, ids, mask in delivered} == want


def test_trainer_refuses_ids_outside_its_vocabulary():
    torch = pytest.importorskip("torch")
    from dispatcher_server import protocol as P
    from dispatcher_server.batching import Sample, build_batch, rank_message
    from dispatcher_server.planner import PlannerConfig, Topology, plan_step
    from trainer_client.client import decode_step
    from trainer_client.model import ModelConfig, ReferenceModel
    from trainer_client.train import ItemInputs

    tokens = TextTokens(np.array([5, 300, 7], np.int32), np.array([0, 1, 1], np.uint8))
    batch = build_batch([Sample(key="k-wide", pos=0, index=0, text_len=3, llm_len=3, tokens=tokens.to_wire(),
                                items=[], payloads=[], nbytes=0)])
    plan = plan_step(batch.inputs, Topology(world_size=1, ranks_per_node=1), PlannerConfig(num_microbatches=1))
    (mb,) = decode_step(P.decode(rank_message(batch, plan, step=0, epoch=0, rank=0, seq=1))).microbatches
    assert mb.loss_mask[0].tolist() == [False, True, True]
    wide = ItemInputs(mb, ReferenceModel(ModelConfig.tiny(vocab_size=512)))
    assert wide.text(0).tolist() == [5, 300, 7]
    byte_model = ReferenceModel(ModelConfig.tiny(vocab_size=load_tokenizer(None).vocab_size))
    with pytest.raises(ValueError, match="'k-wide': token id 300 is outside the model's vocabulary of 256"):
        ItemInputs(mb, byte_model).text(0)
    assert torch.is_tensor(wide.mask(0))


def test_the_direct_chatml_cut_equals_the_rendered_one():
    import random

    from pipeline.tokenize import CHATML, ChatTemplate

    template = ChatTemplate(CHATML, name="chatml")
    assert template.chatml
    rng = random.Random(0)
    for _ in range(200):
        turns = [{"role": rng.choice(["system", "user", "assistant", "tool"]),
                  "content": "".join(rng.choice("ab <|>\n{}%é") for _ in range(rng.randint(0, 12)))}
                 for _ in range(rng.randint(1, 7))]
        assert template.segments(turns) == template.rendered_segments(turns)
        assert "".join(t for t, _ in template.segments(turns)) == template.render(turns)


#: Chat templates as real tokenizer_config.json files ship them (Llama 3 and Gemma trim each
#: content; Qwen2 adds a default system turn; Mistral enforces alternation), and one whose
#: output depends on the content itself.
_TEMPLATES = {
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
              "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
              "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
              "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    "gemma": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}"
             "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
             "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}",
    "qwen2": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
             "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
             "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "mistral": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
               "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
               "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
               "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
               "{{ message['content'] + eos_token}}{% endif %}{% endfor %}",
    "by_content": "{% for m in messages %}{% if 'x' in m['content'] %}<X>{% endif %}"
                  "{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}<end>{% endif %}"
                  "\\n{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(_TEMPLATES))
def test_a_template_cuts_every_conversation_as_rendering_each_prefix_does(name):
    """The cut found in one render (from a per-role-sequence cut with marker contents) equals
    the general prefix-rendering cut, or is not taken: trimmed contents, content-dependent
    templates and refused conversations included."""
    import random

    from pipeline.tokenize import ChatTemplate, ChatTemplateError

    template = ChatTemplate(_TEMPLATES[name], bos_token="<s>", eos_token="</s>", name=name)
    rng = random.Random(1)
    cut = 0
    for _ in range(150):
        roles = (["user", "assistant"] * 4)[:rng.randint(1, 8)] if rng.random() < 0.7 else \
            [rng.choice(["system", "user", "assistant"]) for _ in range(rng.randint(1, 6))]
        turns = [{"role": r, "content": "".join(rng.choice("ab x\n\t{}é") for _ in range(rng.randint(0, 10)))}
                 for r in roles]
        try:
            want = template.rendered_segments(turns)
        except ChatTemplateError:
            with pytest.raises(ChatTemplateError):
                template.segments(turns)
            continue
        assert template.segments(turns) == want
        cut += template._from_skeleton(turns) is not None
    assert cut >= 10  # the one-render cut was taken for many of them


def test_a_trimming_template_masks_the_assistant_content_and_its_end_of_turn(data):
    """Llama 3's template trims each content: the turn is still found (a sentinel of control
    characters was trimmed away, and every conversation was refused as chat_template)."""
    from pipeline.tokenize import ChatTemplate

    template = ChatTemplate(_TEMPLATES["llama3"], bos_token="<|begin_of_text|>", name="llama3")
    turns = [{"role": "user", "content": "  What is shown? "}, {"role": "assistant", "content": " A cat.\n"}]
    assert template.segments(turns) == [
        ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is shown?<|eot_id|>", 0),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0), ("A cat.<|eot_id|>", 1)]


def _sentencepiece_style(tmp_path) -> str:
    """A small BPE with Llama 2's normalizer (a word boundary prepended, spaces as ▁)."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    corpus = ["hello world, what is shown in the image?", "A cat sitting on a mat.",
              "[INST] describe [/INST] It is a dog."] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz▁[]/,.?AIT")))
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


def test_a_conversation_is_tokenized_whole_as_the_model_sees_it(tmp_path):
    """The ids are the tokenizer's encoding of the rendered conversation (apply_chat_template's):
    tokenizing the template's pieces one by one gave a SentencePiece-style tokenizer a word
    boundary at the start of every piece. The mask covers exactly the tokens of assistant text."""
    from pipeline.tokenize import ChatTemplate, HFTokenizer

    path = _sentencepiece_style(tmp_path)
    hf = tokenizers.Tokenizer.from_file(path)
    enc = TextEncoder(HFTokenizer(path), ChatTemplate(_TEMPLATES["mistral"], bos_token="<s>",
                                                      eos_token="</s>", name="mistral"))
    turns = [{"role": "user", "content": "what is shown in the image?"},
             {"role": "assistant", "content": "A cat sitting on a mat."},
             {"role": "user", "content": "describe"}, {"role": "assistant", "content": "It is a dog."}]
    got = enc.conversation(turns)
    whole = hf.encode(enc.template.render(turns), add_special_tokens=False)
    assert got.ids.tolist() == whole.ids
    assert got.ids.tolist() != [i for t, _ in enc.template.segments(turns)
                                for i in hf.encode(t, add_special_tokens=False).ids]  # pieces differ
    targets = [tok for tok, m in zip(whole.tokens, got.mask) if m]
    assert "".join(targets).replace("▁", " ") == "A cat sitting on a mat.</s>It is a dog.</s>"


def test_a_token_straddling_an_assistant_edge_is_a_target():
    """Offsets decide the mask: a token holding any assistant character is a target (byte ids
    stand for their character; a multi-byte one gives all its bytes its mark)."""
    from pipeline.tokenize import ChatTemplate

    class Pairs:  # merges every two characters, across piece edges
        name, vocab_size = "pairs", 1 << 16

        def encode(self, text):
            return self.encode_with_offsets(text)[0]

        def encode_with_offsets(self, text):
            starts = np.arange(0, len(text), 2)
            return starts.astype(np.int32), np.stack([starts, np.minimum(starts + 2, len(text))], 1)

    template = ChatTemplate("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}")
    turns = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cde"}]
    # "u:ab;" (0) "a:" (0) "cde;" (1): pairs "u:" "ab" ";a" ":c" "de" ";"
    assert TextEncoder(Pairs(), template).conversation(turns).mask.tolist() == [0, 0, 0, 1, 1, 1]
    ids, spans = ByteTokenizer().encode_with_offsets("aé")
    assert ids.tolist() == [97, 0xC3, 0xA9] and spans.tolist() == [[0, 1], [1, 2], [1, 2]]


def test_reply_roles_by_other_names_are_trained_on_and_a_conversation_without_one_is_warned_of(caplog):
    """Gemini's `model`, `bot` and capitalized roles were left as they came, so the sample's
    loss mask was all zero and training went on silently on nothing."""
    import logging

    from pipeline.counting import _turn

    enc = TextEncoder(ByteTokenizer(), resolve_chat_template(None, None))
    for reply in ("model", "Assistant", "bot", "GPT", " assistant "):
        turns = [_turn({"role": "User", "content": "hi"}, "t"), _turn({"role": reply, "content": "yo"}, "t")]
        assert [t["role"] for t in turns] == ["user", "assistant"]
        got = enc.conversation(turns)
        assert ByteTokenizer.decode(got.ids[got.mask == 1]) == "yo<|im_end|>\n"
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        for k in range(3):
            assert not enc.conversation([{"role": "user", "content": "hi"}],
                                        where={"shard": "s.tar", "key": f"k{k}"}).mask.any()
    warned = [r.getMessage() for r in caplog.records if "conversation_without_targets" in r.getMessage()]
    assert len(warned) == 1 and "roles=user" in warned[0] and "'assistant'" in warned[0]
    # the sample it was found in, as every per-sample line names it (probe: neither was said)
    assert "shard=s.tar key=k0 " in warned[0], warned[0]


def test_sharegpt_function_call_and_observation_turns_are_the_assistant_and_tool_roles():
    """LLaMA-Factory's ShareGPT tool use (human, function_call, observation, gpt): the model's
    call was an unknown role, rendered as such with mask 0, so the call went untrained."""
    call = '{"name": "get_w", "arguments": {"city": "Paris"}}'
    raw = {"conversations": [{"from": "human", "value": "weather in Paris?"},
                             {"from": "function_call", "value": call},
                             {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}]}
    got = Counter(CountingConfig(text=TextConfig())).text(json.dumps(raw).encode(), "json", "m")
    assert ByteTokenizer.decode(got.ids) == ("<|im_start|>user\nweather in Paris?<|im_end|>\n"
                                             f"<|im_start|>assistant\n{call}<|im_end|>\n"
                                             "<|im_start|>tool\nsunny<|im_end|>\n"
                                             "<|im_start|>assistant\nSunny.<|im_end|>\n")
    assert ByteTokenizer.decode(got.ids[got.mask == 1]) == f"{call}<|im_end|>\nSunny.<|im_end|>\n"


def test_a_tool_call_turn_is_rendered_and_trained_on_not_refused():
    """An OpenAI-style assistant turn of tool calls (content null) refused the whole sample as
    bad_json; `tojson` renders as transformers' does (jinja2's escapes < > & ' for HTML)."""
    from pipeline.counting import Counter, CountingConfig, TextConfig
    from pipeline.tokenize import ChatTemplate

    source = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}"
              "{{ m['content'] }}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
              "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
              "{% endfor %}")
    turns = [{"role": "user", "content": "weather in <Paris> & co?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "get", "arguments": {"q": "<Paris>"}}}]},
             {"role": "tool", "tool_call_id": "1", "name": "get", "content": "sunny"},
             {"role": "assistant", "content": "Sunny."}]
    from pipeline.counting import _turn

    normalized = [_turn(t, "k.json") for t in turns]
    assert normalized[1]["content"] == "" and normalized[2]["tool_call_id"] == "1"
    enc = TextEncoder(ByteTokenizer(), ChatTemplate(source, name="tools"))
    got = enc.conversation(normalized)
    text = ByteTokenizer.decode(got.ids[got.mask == 1])
    assert text == ('<tool_call>{"name": "get", "arguments": {"q": "<Paris>"}}</tool_call><|im_end|>\n'
                    "Sunny.<|im_end|>\n")
    assert got.ids.tolist() == ByteTokenizer().encode(enc.template.render(normalized)).tolist()
    counter = Counter(CountingConfig(text=TextConfig()))
    assert counter.member_text(json.dumps({"messages": turns}).encode(), "json", "k.json")[1]["tool_calls"]


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_a_turn_of_weight_zero_is_not_trained_on(template):
    """ShareGPT's (axolotl's) per-turn `weight`: 0 keeps an assistant turn as context only;
    it was ignored and the turn trained on."""
    from pipeline.counting import _turn
    from pipeline.tokenize import ChatTemplate

    source = CHATML if template == "chatml" else _TEMPLATES["llama3"]
    enc = TextEncoder(ByteTokenizer(), ChatTemplate(source, name=template))
    raw = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "draft", "weight": 0},
           {"from": "human", "value": "again"}, {"from": "gpt", "value": "final", "weight": 1}]
    turns = [_turn(t, "k.json") for t in raw]
    got = enc.conversation(turns)
    targets = ByteTokenizer.decode(got.ids[got.mask == 1])
    assert "final" in targets and "draft" not in targets
    plain = enc.conversation([{k: v for k, v in t.items() if k != "weight"} for t in turns])
    assert got.ids.tolist() == plain.ids.tolist()  # the text is the same, only the mask differs
    assert "draft" in ByteTokenizer.decode(plain.ids[plain.mask == 1])
    for bad in (-1, "0", True, float("nan")):
        with pytest.raises(Exception, match="weight"):
            _turn({"from": "gpt", "value": "x", "weight": bad}, "k.json")


@pytest.mark.parametrize("where", ["jinja file", "tokenizer_config.json"])
def test_a_template_naming_an_unknown_filter_is_a_one_line_error(tmp_path, where):
    """Compiling (not parsing) finds the filter missing: it raised a TemplateAssertionError
    traceback from inspect and read."""
    source = "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"
    path = tmp_path / ("bad.jinja" if where == "jinja file" else "tokenizer_config.json")
    path.write_text(source if where == "jinja file" else json.dumps({"chat_template": source}))
    with pytest.raises(ValueError, match=r"^chat template '.*' is not valid jinja2 \(line 1: No filter "
                                         r"named 'nosuchfilter'\.\)$"):
        resolve_chat_template(str(path), None)


def test_a_filter_or_test_undefined_inside_a_branch_is_named_once_at_start(tmp_path, caplog):
    """jinja2 compiles an unknown filter inside a conditional, and an unknown test anywhere, to
    an error raised when a conversation reaches it: each such sample was skipped with no word
    at start. Now one line each at start names it and its line; the template still renders
    the conversations that do not reach it."""
    from pipeline.tokenize import ChatTemplate

    source = ("{% for m in messages %}{% if m.role == 'tool' %}{{ m.content | nosuchfilter }}"
              "{% endif %}\n{% if m.content is nosuchtest %}!{% endif %}{{ m.content }}"
              "{% if m.content is string %}.{% endif %}{% endfor %}")
    with caplog.at_level(logging.WARNING, logger="mmdispatch.tokenize"):
        template = ChatTemplate(source, name="mine.jinja")
    lines = [r.getMessage() for r in caplog.records if "chat_template_undefined" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "template=mine.jinja filter=nosuchfilter line=1" in lines[0]
    assert "template=mine.jinja test=nosuchtest line=2" in lines[1]
    assert "skipped (reason chat_template)" in lines[1]
    assert not any("string" in line for line in lines)  # a test jinja2 defines is not named
    with pytest.raises(Exception, match="nosuchtest"):  # reached: the sample is refused as before
        template.render([{"role": "user", "content": "hi"}])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmdispatch.tokenize"):
        ChatTemplate("{% for m in messages %}{{ m.content | trim | tojson }}{% endfor %}", name="ok")
    assert not caplog.records


def test_an_empty_conversation_list_is_an_empty_sample_under_any_template(tmp_path):
    """`[]` under a template that reads messages[0] was skipped as `chat_template`, naming an
    internal class; `{"conversations": []}` and ChatML give `empty_sample`."""
    import io
    import tarfile

    from pipeline.errors import ErrorStats

    jinja = tmp_path / "first.jinja"
    jinja.write_text("{{ messages[0].role }}:{% for m in messages %}{{ m.content }}|{% endfor %}")
    shard = tmp_path / "0.tar"
    with tarfile.open(shard, "w") as tar:
        for key, value in (("list", []), ("field", {"conversations": []})):
            data = json.dumps(value).encode()
            info = tarfile.TarInfo(f"{key}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    for template in (str(jinja), "chatml"):
        assert len(TextEncoder.load(None, template).conversation([])) == 0
        stats = ErrorStats()
        config = ReaderConfig(counting=CountingConfig(text=TextConfig(chat_template=template)))
        assert list(iter_shard(str(shard), config, stats=stats)) == []
        assert stats.by_reason == {"empty_sample": 2}, list(stats.recent)
