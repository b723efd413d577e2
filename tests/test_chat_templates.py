"""Chat templates as real models ship them: their context, the files they come from, templates
that rewrite earlier turns, content parts, and the session refusing readers whose templates
differ. Ids are compared with a reference rendering by transformers' conventions (jinja2
sandbox, trim_blocks/lstrip_blocks, its `tojson`, `raise_exception`, `strftime_now`, `tools` and
`documents`, the special tokens), tokenized whole, as `apply_chat_template(tokenize=True)` does."""

from __future__ import annotations

import json
import logging
from datetime import datetime

import numpy as np
import pytest

from pipeline.counting import CountError, Counter, CountingConfig, TextConfig
from pipeline.tokenize import ChatTemplate, ChatTemplateError, TextEncoder, resolve_chat_template

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "[INST]", "[/INST]",
            "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]

# --- templates as the models ship them (whitespace control as in their tokenizer_config.json) ---
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- set ns.index = ns.index + 1 %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}"""

QWEN2_VL = """{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}<|im_end|>
{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

#: Llama 3.2's date line (the rest as ChatML, for brevity).
LLAMA32_DATE = """{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{{- bos_token + "Today Date: " + date_string + "\\n\\n" }}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"""


def reference(source: str, turns: list[dict], config: dict | None = None, **context) -> str:
    """What transformers' `apply_chat_template(tokenize=False)` renders (its conventions)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
    specials = {k: v for k, v in (config or {}).items() if k.endswith("_token")}
    return env.from_string(source).render(messages=turns, tools=context.get("tools"),
                                          documents=context.get("documents"),
                                          add_generation_prompt=False, **specials)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["what is in the image? a cat on a mat.", "think about it: the answer is 42.",
              "weather in Paris is sunny", '{"name": "get", "arguments": {"q": "x"}}'] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _model_dir(tmp_path, tokenizer_file: str, template: str | None, *, jinja: str | None = None,
               **specials) -> str:
    """A model folder as the hub holds it: tokenizer.json, tokenizer_config.json, maybe a
    chat_template.jinja. Returns the tokenizer.json path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tokenizer.json"
    path.write_bytes(open(tokenizer_file, "rb").read())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **specials}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return str(path)


def _check(enc: TextEncoder, tokenizer_file: str, source: str, turns: list[dict], config: dict,
           targets: list[str], **context) -> None:
    """Ids equal the tokenizer's encoding of the reference rendering, and the mask covers
    exactly `targets`, in order (each assistant content as rendered and its end of turn)."""
    hf = tokenizers.Tokenizer.from_file(tokenizer_file)
    got = enc.conversation(turns, **context)
    text = reference(source, turns, config, **context)
    want = hf.encode(text, add_special_tokens=False)
    assert got.ids.tolist() == want.ids
    masked = [(a, b) for (a, b), m in zip(want.offsets, got.mask) if m]
    runs, last = [], None
    for a, b in masked:  # merge adjacent targets into runs of text
        if last is not None and runs and a <= last:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
        last = b
    assert [text[a:b] for a, b in runs] == targets


# 1. ---------------------------------------------------------------------------------------
def test_readers_rendering_with_different_templates_are_refused_like_a_tokenizer_mismatch(tmp_path, tokenizer_file):
    from dispatcher_server.inputs import InputRules
    from pipeline.service import input_rules
    from pipeline.tokenize import tokenizer_identity

    a = _model_dir(tmp_path / "a", tokenizer_file, QWEN25, eos_token="<|im_end|>")
    b = _model_dir(tmp_path / "b", tokenizer_file, QWEN3, eos_token="<|im_end|>")
    c = _model_dir(tmp_path / "c", tokenizer_file, QWEN25, eos_token="</s>")  # other special tokens
    rules = {k: input_rules(CountingConfig(text=TextConfig(tokenizer_path=p))) for k, p in
             (("a", a), ("b", b), ("c", c))}
    assert rules["a"]["tokenizer"] == rules["b"]["tokenizer"] == rules["c"]["tokenizer"]
    assert len({r["chat_template"] for r in rules.values()}) == 3
    session = InputRules()
    assert session.admit("reader 'a'", rules["a"]) is None
    why = session.admit("reader 'b'", rules["b"])
    assert why is not None and "chat_template" in why and "tokenizer:" not in why
    assert session.admit("reader 'a2'", dict(rules["a"])) is None
    # A trainer states the tokenizer only (it receives ids); the built-in is named.
    trainer = tokenizer_identity(a)
    assert set(trainer) == {"tokenizer"} and session.admit("rank 0", trainer) is None
    assert input_rules(CountingConfig())["chat_template"] == "chatml"
    assert "chat_template" not in input_rules(CountingConfig(text=TextConfig(estimate=True)))


# 2. ---------------------------------------------------------------------------------------
def test_chat_template_jinja_beside_the_tokenizer_is_used_first(tmp_path, tokenizer_file):
    path = _model_dir(tmp_path, tokenizer_file, QWEN25, jinja=MISTRAL_V03, bos_token="<s>", eos_token="</s>")
    template = resolve_chat_template(None, path)
    assert template.name.endswith("chat_template.jinja") and template.source == MISTRAL_V03
    enc = TextEncoder.load(path)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a cat"}]
    _check(enc, tokenizer_file, MISTRAL_V03, turns, {"bos_token": "<s>", "eos_token": "</s>"}, [" a cat</s>"])  # " a" is one token


@pytest.mark.parametrize("value", ["absent", None])
def test_a_tokenizer_without_a_template_falls_back_to_chatml_with_one_warning(tmp_path, tokenizer_file,
                                                                          caplog, value):
    path = _model_dir(tmp_path, tokenizer_file, None)
    if value == "absent":
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        first = resolve_chat_template(None, path)
        resolve_chat_template(None, path)
    warned = [r.getMessage() for r in caplog.records if "chat_template_fallback" in r.getMessage()]
    assert len(warned) == 1 and path in warned[0] and "ChatML" in warned[0]
    assert first.chatml and first.name == "chatml (fallback)" and first.identity == "chatml"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        resolve_chat_template(None, None)  # byte-level ids: ChatML is the documented default
        resolve_chat_template("chatml", path)
    assert not [r for r in caplog.records if "chat_template_fallback" in r.getMessage()]


# 3. ---------------------------------------------------------------------------------------
def test_an_img2dataset_caption_in_json_beside_the_txt_counts_once():
    counter = Counter(CountingConfig())
    meta = json.dumps({"caption": "a cat", "url": "http://x", "width": 10}).encode()
    values = [(counter.member_text(meta, "json", "member 'json'"), "member 'json'"),
              (counter.member_text(b"a cat", "txt", "member 'txt'"), "member 'txt'")]
    kept = Counter.sample_texts(values)
    assert [v for v, _ in kept] == ["a cat"] and kept[0][1] == "member 'txt'"
    # Without a text member the JSON's caption is the text; a JSON conversation always counts.
    assert [v for v, _ in Counter.sample_texts(values[:1])] == ["a cat"]
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    both = [(counter.member_text(chat, "json", "j"), "j"), values[1]]
    assert Counter.sample_texts(both) == both


def test_an_img2dataset_sample_through_the_reader_counts_its_caption_once(tmp_path):
    """Needs the reader to pass a sample's member texts through `Counter.sample_texts`."""
    import io
    import tarfile

    from PIL import Image

    from pipeline.reader import ReaderConfig, iter_shard

    png = io.BytesIO()
    Image.new("RGB", (56, 56)).save(png, "PNG")
    shard = tmp_path / "0.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in (("k.png", png.getvalue()), ("k.txt", b"a cat"),
                           ("k.json", json.dumps({"caption": "a cat", "key": "k"}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (record,) = list(iter_shard(str(shard), ReaderConfig()))
    assert record.text_len == len(b"a cat")


# 4. ---------------------------------------------------------------------------------------
def test_the_template_gets_the_context_transformers_gives_it(tmp_path, tokenizer_file):
    tools_template = ("{%- if tools is not none %}{{ tools|tojson }}{% endif %}"
                      "{%- if documents is not none %}{{ documents|length }} docs{% endif %}"
                      "{{ pad_token }}{{ unk_token }}"
                      "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    counter = Counter(CountingConfig(text=TextConfig(tokenizer_path=_model_dir(
        tmp_path / "t", tokenizer_file, tools_template, pad_token="<pad>", unk_token="<unk>"))))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a cat"}]
    plain = counter.text(json.dumps({"messages": turns}).encode(), "json", "m")  # was count_failed
    tools = [{"type": "function", "function": {"name": "get"}}]
    with_tools = counter.text(json.dumps({"messages": turns, "tools": tools, "documents": [{"t": 1}]}).encode(),
                              "json", "m")
    hf = tokenizers.Tokenizer.from_file(tokenizer_file)
    config = {"pad_token": "<pad>", "unk_token": "<unk>"}
    assert plain.ids.tolist() == hf.encode(reference(tools_template, turns, config), add_special_tokens=False).ids
    assert with_tools.ids.tolist() == hf.encode(reference(tools_template, turns, config, tools=tools,
                                                          documents=[{"t": 1}]), add_special_tokens=False).ids
    assert hf.decode(with_tools.ids.tolist(), skip_special_tokens=False).startswith('[{"type": "function"')


def test_a_turns_other_fields_reach_the_template(tmp_path, tokenizer_file):
    """Qwen3 renders `reasoning_content` (it was dropped with every field but role/content)."""
    path = _model_dir(tmp_path, tokenizer_file, QWEN3)
    counter = Counter(CountingConfig(text=TextConfig(tokenizer_path=path)))
    turns = [{"role": "user", "content": "what is 6*7?"},
             {"role": "assistant", "content": "42.", "reasoning_content": "think about it"}]
    got = counter.text(json.dumps(turns).encode(), "json", "m")
    hf = tokenizers.Tokenizer.from_file(tokenizer_file)
    assert "think about it" in hf.decode(got.ids.tolist(), skip_special_tokens=False)
    _check(counter.encoder, tokenizer_file, QWEN3, turns, {},
           ["<think>\nthink about it\n</think>\n\n42.<|im_end|>\n"])


def test_strftime_now_renders_todays_date(tmp_path, tokenizer_file):
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, LLAMA32_DATE, bos_token="<s>"))
    got = enc.conversation([{"role": "user", "content": "hi"}])
    text = tokenizers.Tokenizer.from_file(tokenizer_file).decode(got.ids.tolist(), skip_special_tokens=False)
    assert datetime.now().strftime("%d %b %Y") in text and "26 Jul 2024" not in text


# 5. ---------------------------------------------------------------------------------------
def test_content_parts_reach_the_template(tmp_path, tokenizer_file):
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, QWEN2_VL))
    counter = Counter(CountingConfig(text=TextConfig(tokenizer_path=str(tmp_path / "tokenizer.json"))))
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]},
             {"role": "assistant", "content": "a cat on a mat."}]
    got = counter.text(json.dumps({"messages": turns}).encode(), "json", "m")
    text = tokenizers.Tokenizer.from_file(tokenizer_file).decode(got.ids.tolist(), skip_special_tokens=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>describe<|im_end|>" in text
    _check(enc, tokenizer_file, QWEN2_VL, turns, {}, ["a cat on a mat.<|im_end|>\n"])
    # An assistant content of parts is located too.
    parts = [turns[0], {"role": "assistant", "content": [{"type": "text", "text": "a cat."}]}]
    _check(enc, tokenizer_file, QWEN2_VL, parts, {}, ["a cat.<|im_end|>\n"])
    # The built-in ChatML joins the text parts.
    chatml = Counter(CountingConfig())
    got = chatml.text(json.dumps({"messages": turns}).encode(), "json", "m")
    assert bytes(got.ids.astype(np.uint8)).decode().startswith("<|im_start|>user\ndescribe<|im_end|>")


def test_a_content_list_of_plain_strings_is_refused_not_emptied():
    counter = Counter(CountingConfig())
    with pytest.raises(CountError, match="content list holds a str") as err:
        counter.text(json.dumps({"messages": [{"role": "user", "content": ["hello", "world"]}]}).encode(),
                     "json", "m")
    assert err.value.reason == "bad_json"


# 6. ---------------------------------------------------------------------------------------
def test_qwen3_multi_turn_and_reasoning_replies_are_rendered_and_masked(tmp_path, tokenizer_file):
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, QWEN3))
    multi = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is in the image?"},
             {"role": "assistant", "content": "<think>\nlook\n</think>\n\na cat."},
             {"role": "user", "content": "and 6*7?"},
             {"role": "assistant", "content": "<think>think about it</think>the answer is 42."}]
    # The earlier reply's reasoning is dropped by the template; the last one's is rendered.
    _check(enc, tokenizer_file, QWEN3, multi, {},
           ["a cat.<|im_end|>\n", "<think>\nthink about it\n</think>\n\nthe answer is 42.<|im_end|>\n"])
    one = multi[:3]
    _check(enc, tokenizer_file, QWEN3, one, {}, ["<think>\nlook\n</think>\n\na cat.<|im_end|>\n"])
    plain = [multi[1], {"role": "assistant", "content": "a cat."}, multi[3], {"role": "assistant", "content": "42"}]
    _check(enc, tokenizer_file, QWEN3, plain, {}, ["a cat.<|im_end|>\n", "42<|im_end|>\n"])


def test_qwen25_parallel_tool_results_and_tool_call_turns_are_rendered_and_masked(tmp_path, tokenizer_file):
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, QWEN25))
    call = {"type": "function", "function": {"name": "get", "arguments": {"q": "Paris"}}}
    turns = [{"role": "user", "content": "weather in Paris and Rome?"},
             {"role": "assistant", "content": "", "tool_calls": [call, call]},
             {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"},
             {"role": "assistant", "content": "Paris is sunny", "tool_calls": [call]},
             {"role": "tool", "content": "sunny"},
             {"role": "assistant", "content": "weather in Paris is sunny"}]
    calls = '\n<tool_call>\n{"name": "get", "arguments": {"q": "Paris"}}\n</tool_call>'
    _check(enc, tokenizer_file, QWEN25, turns, {},
           [calls * 2 + "<|im_end|>\n", "Paris is sunny" + calls + "<|im_end|>\n",
            "weather in Paris is sunny<|im_end|>\n"])


def test_reasoning_in_a_reasoning_content_field_is_trained_as_inline_reasoning(tmp_path, tokenizer_file):
    """Qwen3 renders `reasoning_content` as it renders `<think>` in the content: the same ids
    took a mask without the reasoning (only the answer), and either form's mask began after
    the `<think>` tag, which the model generates."""
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, QWEN3))
    call = {"type": "function", "function": {"name": "get", "arguments": {"q": "Paris"}}}
    inline = [{"role": "user", "content": "what is in the image?"},
              {"role": "assistant", "content": "<think>\nlook\n</think>\n\na cat."},
              {"role": "user", "content": "and 6*7?"},
              {"role": "assistant", "content": "<think>\nthink about it\n</think>\n\n", "tool_calls": [call]},
              {"role": "tool", "content": "sunny"},
              {"role": "assistant", "content": "<think>\nit is sunny\n</think>\n\nthe answer is 42."}]
    field = [{**t, "content": t["content"].split("</think>\n\n")[-1],
              "reasoning_content": t["content"].split("\n")[1]} if "<think>" in t["content"] else t
             for t in inline]
    targets = ["a cat.<|im_end|>\n",  # the template drops reasoning before the last user turn
               '<think>\nthink about it\n</think>\n\n<tool_call>\n{"name": "get", "arguments": '
               '{"q": "Paris"}}\n</tool_call><|im_end|>\n',
               "<think>\nit is sunny\n</think>\n\nthe answer is 42.<|im_end|>\n"]
    for turns in (inline, field, inline[:2], field[:2]):
        want = targets if len(turns) > 2 else ["<think>\nlook\n</think>\n\na cat.<|im_end|>\n"]
        _check(enc, tokenizer_file, QWEN3, turns, {}, want)
    assert enc.conversation(field).mask.tolist() == enc.conversation(inline).mask.tolist()


def test_a_repeated_tool_call_takes_its_occurrences_in_order(tmp_path, tokenizer_file):
    """Two identical tool-call turns (a poll, a retry) were refused, the call text occurring
    twice between the located turns; a quote of it elsewhere still leaves no exact mask."""
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, QWEN25))
    call = {"type": "function", "function": {"name": "get", "arguments": {"q": "Paris"}}}
    other = {"type": "function", "function": {"name": "get", "arguments": {"q": "Rome"}}}
    turns = [{"role": "user", "content": "weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "wait"},
             {"role": "assistant", "content": "", "tool_calls": [other]}, {"role": "tool", "content": "rain"},
             {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"},
             {"role": "assistant", "content": "weather in Paris is sunny"}]
    text = '\n<tool_call>\n{"name": "get", "arguments": {"q": "%s"}}\n</tool_call><|im_end|>\n'
    _check(enc, tokenizer_file, QWEN25, turns, {},
           [text % "Paris", text % "Rome", text % "Paris", "weather in Paris is sunny<|im_end|>\n"])
    quoted = [*turns[:4], {"role": "tool", "content": "you said:" + text % "Paris"}, *turns[5:]]
    with pytest.raises(ChatTemplateError, match="tool calls once"):
        enc.conversation(quoted)
    # A call made again inside a later parallel call: its text ends the parallel turn's too,
    # but only one placement of the two turns in order exists.
    parallel = [*turns[:2], {"role": "tool", "content": "wait"},
                {"role": "assistant", "content": "", "tool_calls": [call, call]},
                {"role": "tool", "content": "rain"}, {"role": "tool", "content": "sunny"}, turns[-1]]
    both = '\n<tool_call>\n{"name": "get", "arguments": {"q": "Paris"}}\n</tool_call>'
    _check(enc, tokenizer_file, QWEN25, parallel, {},
           [text % "Paris", both + text % "Paris", "weather in Paris is sunny<|im_end|>\n"])


#: The ChatML template with transformers' `{% generation %}` marks: the reply and its end of
#: turn are generated, the newline after it is not.
GENERATION = ("{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
              "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
              "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")


def test_generation_blocks_are_the_mask(tmp_path, tokenizer_file):
    """A template that marks what the model generates with `{% generation %}` (transformers'
    `return_assistant_tokens_mask`) is masked by exactly those blocks: the tag was rendered
    as its body and the mask took the per-turn cut (the newline after `<|im_end|>` too)."""
    path = _model_dir(tmp_path, tokenizer_file, GENERATION)
    counter = Counter(CountingConfig(text=TextConfig(tokenizer_path=path)))
    template = counter.encoder.template
    turns = [{"role": "user", "content": "what is in the image?"}, {"role": "assistant", "content": "a dog"},
             {"role": "user", "content": "sure?"}, {"role": "assistant", "content": "a cat on a mat."}]
    segments = template.segments(turns)
    assert "".join(t for t, _ in segments) == template.render(turns)
    assert [t for t, m in segments if m] == ["a dog<|im_end|>", "a cat on a mat.<|im_end|>"]
    hf = tokenizers.Tokenizer.from_file(tokenizer_file)
    got = counter.encoder.conversation(turns)
    assert got.ids.tolist() == hf.encode(template.render(turns), add_special_tokens=False).ids
    assert hf.decode(got.ids[got.mask == 1].tolist(), skip_special_tokens=False) == \
        "a dog<|im_end|>a cat on a mat.<|im_end|>"
    # ShareGPT's weight 0: that turn's block (the k-th block is the k-th reply's) is context.
    weighted = json.dumps([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a dog", "weight": 0},
                           {"from": "human", "value": "sure?"}, {"from": "gpt", "value": "a cat"}])
    got = counter.text(weighted.encode(), "json", "m")
    assert hf.decode(got.ids[got.mask == 1].tolist(), skip_special_tokens=False) == "a cat<|im_end|>"
    untrained = template.segments(turns, (True, False, True, True))
    assert [t for t, m in untrained if m] == ["a cat on a mat.<|im_end|>"]
    # Blocks that do not pair with the replies, or a text holding a marker: no exact mask.
    two = ChatTemplate(GENERATION.replace("{% generation %}", "{% generation %}{% endgeneration %}"
                                          "{% generation %}"), name="two blocks a reply")
    with pytest.raises(ChatTemplateError, match="4 .*blocks for 2 assistant turns"):
        two.segments(turns, (True, False, True, True))
    assert [t for t, m in two.segments(turns) if m] == ["a dog<|im_end|>", "a cat on a mat.<|im_end|>"]
    with pytest.raises(ChatTemplateError, match="cannot place"):
        template.segments([{"role": "user", "content": "MMDISPATCHxGENERATIONxEND"}, turns[1]])
    # A block's output captured and trimmed: the markers kept its edge, so the text differed
    # from the rendering (ids other than apply_chat_template's, unsaid). Refused instead.
    trimmed = ChatTemplate("{% for m in messages %}{% if m.role == 'assistant' %}{% set body %}"
                           "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}{% endset %}"
                           "<|im_start|>assistant\n{{ body | trim }}{% else %}<|im_start|>{{ m.role }}\n"
                           "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}", name="trimmed")
    with pytest.raises(ChatTemplateError, match="changes the text of its"):
        trimmed.segments(turns[:2])


def test_mistral_v03_with_a_system_message_is_rendered_and_masked(tmp_path, tokenizer_file):
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, MISTRAL_V03, **config))
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is in the image?"},
             {"role": "assistant", "content": " a cat. "}, {"role": "user", "content": "sure?"},
             {"role": "assistant", "content": "yes"}]
    _check(enc, tokenizer_file, MISTRAL_V03, turns, config, [" a cat.</s>", "yes</s>"])  # "Ġa" is a token
    with pytest.raises(ChatTemplateError, match="must alternate"):
        enc.conversation(turns[:2] + turns[3:])


def test_an_assistant_content_the_template_rewrites_is_refused(tmp_path, tokenizer_file):
    """Located only when the rendering holds it as written (trimmed at most): a template that
    changes an earlier reply (here: upper-cases it) leaves no exact mask."""
    source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.last %}{{ m.content }}"
              "{% else %}{{ m.content|upper }}{% endif %}<|im_end|>\n{% endfor %}")
    enc = TextEncoder.load(_model_dir(tmp_path, tokenizer_file, source))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a cat"},
             {"role": "user", "content": "ok"}]
    with pytest.raises(ChatTemplateError, match="cannot locate"):
        enc.conversation(turns)


# 7. ---------------------------------------------------------------------------------------
def test_a_tokenizer_config_passed_as_the_tokenizer_is_named(tmp_path, tokenizer_file):
    from pipeline.tokenize import load_tokenizer

    _model_dir(tmp_path, tokenizer_file, QWEN25)
    with pytest.raises(ValueError, match="is a tokenizer_config.json; pass the tokenizer.json beside it"):
        load_tokenizer(str(tmp_path / "tokenizer_config.json"))
    other = tmp_path / "vocab.json"
    other.write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="JSON but not an HF tokenizers JSON file"):
        load_tokenizer(str(other))


def test_a_raise_exception_refusal_names_the_template_file(tmp_path, tokenizer_file):
    path = _model_dir(tmp_path, tokenizer_file, MISTRAL_V03)
    counter = Counter(CountingConfig(text=TextConfig(tokenizer_path=path)))
    with pytest.raises(CountError, match="tokenizer_config.json.*must alternate") as err:
        counter.text(json.dumps([{"role": "assistant", "content": "x"}]).encode(), "json", "m")
    assert err.value.reason == "chat_template"


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_text_is_named_as_utf16(encoding):
    data = ("\ufeff" + "a cat").encode(encoding)
    with pytest.raises(CountError, match="is UTF-16"):
        Counter(CountingConfig()).text(data, "txt", "member 'txt'")


@pytest.mark.parametrize("encoding,member", [("utf-16-le", "txt"), ("utf-16-be", "txt"), ("utf-32-le", "txt"),
                                             ("utf-16-le", "json")])
def test_utf16_or_utf32_text_without_a_byte_order_mark_is_named(encoding, member):
    """Probe: ASCII in UTF-16/32 without a BOM is valid UTF-8, every other byte NUL: it was
    trained as NUL-interleaved ids (a .json got a JSON parse position instead)."""
    text = json.dumps({"caption": "hello world, a cat"}) if member == "json" else "hello world, a cat"
    with pytest.raises(CountError, match=r"UTF-16 or UTF-32 without a byte-order mark.*iconv") as err:
        Counter(CountingConfig()).text(text.encode(encoding), member, f"member {member!r}")
    assert err.value.reason == "bad_text"
    with pytest.raises(CountError, match="is not UTF-8.*UTF-16 or UTF-32 without a byte-order mark"):
        Counter(CountingConfig()).text("東京 café".encode("utf-16-le"), "txt", "member 'txt'")


def test_nul_characters_in_text_are_named():
    with pytest.raises(CountError, match=r"holds NUL characters \(U\+0000, the first at character 4\): "
                                         "binary data"):
        Counter(CountingConfig()).text(b"some\0text that goes on and on", "txt", "member 'txt'")
    with pytest.raises(CountError, match="NUL characters.*UTF-16 or UTF-32"):
        Counter(CountingConfig()).text(b"\0\0\0\0", "txt", "member 'txt'")


# 5. ---------------------------------------------------------------------------------------
TURNS_LOOP = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
NAMED = [{"name": "default", "template": TURNS_LOOP},
         {"name": "tool_use", "template": "{{ tools|tojson }}\n" + TURNS_LOOP}]


@pytest.mark.parametrize("given", ["beside the tokenizer", "as --chat-template"])
def test_a_list_of_named_templates_renders_tool_use_for_samples_given_tools(tmp_path, tokenizer_file, given):
    """transformers' `get_chat_template` takes "tool_use" whenever tools are passed (an empty
    list too), else "default"; every sample was rendered by "default"."""
    path = _model_dir(tmp_path, tokenizer_file, NAMED)
    spec = None if given == "beside the tokenizer" else str(tmp_path / "tokenizer_config.json")
    counter = Counter(CountingConfig(text=TextConfig(tokenizer_path=path, chat_template=spec)))
    turns = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get"}}]
    target = ["sunny<|im_end|>\n"]
    for context, source in (({}, TURNS_LOOP), ({"tools": tools}, NAMED[1]["template"]),
                            ({"tools": []}, NAMED[1]["template"])):
        got = counter.text(json.dumps({"messages": turns, **context}).encode(), "json", "m")
        assert got.ids.tolist() == counter.encoder.conversation(turns, **context).ids.tolist()
        _check(counter.encoder, tokenizer_file, source, turns, {}, target, **context)
    # Readers whose tool_use templates differ render differently: their identities differ.
    other = _model_dir(tmp_path / "other", tokenizer_file, [NAMED[0], {**NAMED[1], "template": TURNS_LOOP}])
    assert resolve_chat_template(None, path).identity != resolve_chat_template(None, other).identity


def test_chat_template_names_one_of_the_tokenizers_named_templates(tmp_path, tokenizer_file):
    path = _model_dir(tmp_path, tokenizer_file, NAMED)
    tools = [{"type": "function", "function": {"name": "get"}}]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a cat"}]
    for name, source in (("default", TURNS_LOOP), ("tool_use", NAMED[1]["template"])):
        enc = TextEncoder.load(path, TextConfig(tokenizer_path=path, chat_template=name).chat_template)
        assert enc.template.name.endswith(f"tokenizer_config.json ({name})")
        # A name is that template for every sample, as apply_chat_template(chat_template=NAME).
        _check(enc, tokenizer_file, source, turns, {}, ["a cat<|im_end|>\n"], tools=tools)
    with pytest.raises(ValueError, match=r"^chat template 'llama9' is neither a built-in \(chatml\), nor "
                                         r"one of the templates '.*tokenizer_config.json' names "
                                         r"\(default, tool_use\), nor a file: pass"):
        TextConfig(tokenizer_path=path, chat_template="llama9")
    # No "default": refused as transformers refuses it, naming the names to pick from.
    alone = _model_dir(tmp_path / "alone", tokenizer_file, NAMED[1:])
    with pytest.raises(ValueError, match="names chat templates tool_use but none 'default': pass "
                                         "--chat-template with one of these names"):
        resolve_chat_template(None, alone)
    assert resolve_chat_template("tool_use", alone).source == NAMED[1]["template"]


OWN_CHATML = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_a_tokenizers_own_template_named_like_a_built_in_wins(tmp_path, tokenizer_file):
    """`--chat-template chatml` rendered the built-in ChatML though the tokenizer_config.json
    lists a template of that name (and the refusal of an unknown name listed it): the
    tokenizer's own wins, as transformers' apply_chat_template(chat_template="chatml") renders
    it. Without a tokenizer, or one that names no "chatml", the name is the built-in."""
    path = _model_dir(tmp_path, tokenizer_file, [NAMED[0], {"name": "chatml", "template": OWN_CHATML}])
    chosen = resolve_chat_template("chatml", path)
    assert chosen.source == OWN_CHATML and chosen.name.endswith("tokenizer_config.json (chatml)")
    assert chosen.identity != "chatml"  # readers on the built-in are told they render differently
    enc = TextEncoder.load(path, TextConfig(tokenizer_path=path, chat_template="chatml").chat_template)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a cat"}]
    _check(enc, tokenizer_file, OWN_CHATML, turns, {}, [" a cat\n"])
    assert resolve_chat_template("chatml", None).chatml
    assert resolve_chat_template("chatml", _model_dir(tmp_path / "named", tokenizer_file, NAMED)).chatml


def _saved_as_files(tmp_path, tokenizer_file, default: str | None, **named: str) -> str:
    """A tokenizer folder as newer transformers saves one: chat_template.jinja (the default)
    and additional_chat_templates/NAME.jinja, the config's chat_template left out."""
    path = _model_dir(tmp_path, tokenizer_file, None, jinja=default)
    (tmp_path / "additional_chat_templates").mkdir()
    for name, source in named.items():
        (tmp_path / "additional_chat_templates" / f"{name}.jinja").write_text(source)
    return path


def test_additional_chat_templates_files_are_the_tokenizers_named_templates(tmp_path, tokenizer_file):
    """additional_chat_templates/NAME.jinja were not read: a sample with tools got the default
    template, not "tool_use", and `--chat-template NAME` was refused. They are named templates
    as a list in tokenizer_config.json is, with chat_template.jinja as "default"."""
    path = _saved_as_files(tmp_path, tokenizer_file, TURNS_LOOP, tool_use=NAMED[1]["template"],
                           chatml=OWN_CHATML)
    turns = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get"}}]
    enc = TextEncoder.load(path)
    assert enc.template.name.endswith("chat_template.jinja") and enc.template.source == TURNS_LOOP
    _check(enc, tokenizer_file, TURNS_LOOP, turns, {}, ["sunny<|im_end|>\n"])
    _check(enc, tokenizer_file, NAMED[1]["template"], turns, {}, ["sunny<|im_end|>\n"], tools=tools)
    for name, source in (("default", TURNS_LOOP), ("tool_use", NAMED[1]["template"]), ("chatml", OWN_CHATML)):
        spec = TextConfig(tokenizer_path=path, chat_template=name).chat_template  # checked at start
        chosen = resolve_chat_template(spec, path)
        assert chosen.source == source, name
    assert resolve_chat_template("chatml", path).name.endswith("additional_chat_templates/chatml.jinja")
    with pytest.raises(ValueError, match=r"^chat template 'llama9' is neither a built-in \(chatml\), nor "
                                         r"one of the templates '.*' names \(default, chatml, tool_use\), "
                                         r"nor a file: pass"):
        TextConfig(tokenizer_path=path, chat_template="llama9")
    # The tokenizer_config.json given as --chat-template reads the files beside it alike.
    given = resolve_chat_template(str(tmp_path / "tokenizer_config.json"), None)
    assert given.source == TURNS_LOOP and given.for_tools(tools).source == NAMED[1]["template"]


def test_additional_chat_templates_without_a_default_are_refused_as_a_list_without_one(tmp_path,
                                                                                      tokenizer_file):
    path = _saved_as_files(tmp_path, tokenizer_file, None, tool_use=NAMED[1]["template"])
    with pytest.raises(ValueError, match=r"^tokenizer folder '.*' names chat templates tool_use but "
                                         r"none 'default': pass --chat-template"):
        resolve_chat_template(None, path)
    assert resolve_chat_template("tool_use", path).source == NAMED[1]["template"]
