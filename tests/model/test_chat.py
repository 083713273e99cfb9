"""Chat templates: rendered text and prompt ids equal transformers' ``apply_chat_template`` (the oracle), on the real
SmolLM2 GGUF and on made templates; errors, the plain fallback, stop tokens and history trimming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from sangama_p2p.errors import CapacityError, ChatTemplateError, CheckpointError, ModelError
from sangama_p2p.model.chat import (
    PLAIN,
    ChatTemplate,
    load_chat_template,
    render_chat,
    render_text,
    stop_ids,
    trim_to_fit,
)
from sangama_p2p.model.tokenizer import Tokenizer, train_bpe

CONVERSATION = [
    {"role": "system", "content": "You are terse. Answer in one word."},
    {"role": "user", "content": "Hi there! What's 2+2?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And   in French, 'quatre'?\n\nSay <|im_end|> too."},
]

LLAMA3 = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'Today is ' + strftime_now('%Y') %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ '' }}{% endgeneration %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
GEMMA = (  # Gemma style: no system role (folded into the first user turn), <end_of_turn>, namespace and tojson
    "{{ bos_token }}{% set ns = namespace(first=true) %}"
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if ns.first else '') + message['content'] | trim }}"
    "{% set ns.first = false %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
)
CHATML_LINES = """{% for message in messages %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}<|im_end|>
    {% else %}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""  # blocks on lines of their own: trim_blocks and lstrip_blocks decide the whitespace
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>",
            "<start_of_turn>", "<end_of_turn>"]


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    """The project's byte-level BPE with the chat markers of Llama 3 and Gemma added as special tokens."""
    tok = train_bpe(400)
    tok.add_special_tokens(SPECIALS)
    return Tokenizer(tok, [tok.token_to_id("<|endoftext|>")])


def hf(tok: Tokenizer, template: str, **specials: str):
    """transformers' tokenizer over the same ``tokenizers`` object, with ``template`` as its chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tok.backend.to_str()),
                                   chat_template=template, **specials)


def oracle(hf_tok, messages, **kw) -> tuple[str, list[int]]:
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
    return text, list(ids)


# ---- the real SmolLM2 GGUF -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path):
    """(our template, our tokenizer, transformers' tokenizer) for SmolLM2-135M-Instruct, all from the GGUF."""
    from transformers import AutoTokenizer

    from sangama_p2p.model.gguf import tokenizer as gguf_tok
    from sangama_p2p.model.gguf.reader import read_metadata

    meta = read_metadata(smollm2_gguf)
    ours = Tokenizer(gguf_tok.tokenizer_from_gguf(meta), [meta.get("tokenizer.ggml.eos_token_id")])
    theirs = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return load_chat_template(smollm2_gguf), ours, theirs


def test_smollm2_multi_turn_prompt_equals_transformers(smol) -> None:
    template, ours, theirs = smol
    assert template.origin == "SmolLM2-135M-Instruct.Q4_1.gguf" and not template.is_plain
    assert template.special("bos_token") == "<|im_start|>" and template.special("eos_token") == "<|im_end|>"
    text, ids = oracle(theirs, CONVERSATION)
    prompt = render_chat(template, ours, CONVERSATION)
    assert prompt.text == text
    assert prompt.text.startswith("<|im_start|>system\nYou are terse.") and prompt.text.endswith("assistant\n")
    assert list(prompt.ids) == ids
    assert ids.count(1) == 5 and ids.count(2) == 5  # <|im_start|>, <|im_end|>: the user's "<|im_end|>" included
    assert prompt.stop_ids == (2,)  # <|im_end|> is both the eos and the turn end


def test_smollm2_without_a_system_message_gets_the_templates_own(smol) -> None:
    template, ours, theirs = smol
    messages = CONVERSATION[1:]
    text, ids = oracle(theirs, messages)
    prompt = render_chat(template, ours, messages)
    assert "You are a helpful AI assistant named SmolLM" in prompt.text
    assert (prompt.text, list(prompt.ids)) == (text, ids)
    assert render_text(template, messages, add_generation_prompt=False) == theirs.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False)


# ---- made templates, transformers as the oracle ----------------------------------------------------------------------
def test_llama3_style_template_equals_transformers(tiny: Tokenizer) -> None:
    template = ChatTemplate(LLAMA3, "llama3", (("bos_token", "<|begin_of_text|>"), ("eos_token", "<|endoftext|>")))
    theirs = hf(tiny, LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
    prompt = render_chat(template, tiny, CONVERSATION)
    assert (prompt.text, list(prompt.ids)) == oracle(theirs, CONVERSATION)
    assert prompt.text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.")
    assert prompt.ids[0] == tiny.token_id("<|begin_of_text|>")  # the bos the template writes, as its special token
    # the eos, and the <|eot_id|> the template ends each assistant turn with
    assert prompt.stop_ids == (tiny.token_id("<|endoftext|>"), tiny.token_id("<|eot_id|>"))


def test_whitespace_around_blocks_is_trimmed_as_transformers_trims_it(tiny: Tokenizer) -> None:
    prompt = render_chat(ChatTemplate(CHATML_LINES, "chatml"), tiny, CONVERSATION)
    assert (prompt.text, list(prompt.ids)) == oracle(hf(tiny, CHATML_LINES), CONVERSATION)
    # the indented block tags vanish with their line; the indent before an expression stays
    assert prompt.text.startswith("<|im_start|>system\nYou are terse. Answer in one word.<|im_end|>\n    <|im_start|>user")


def test_a_system_message_is_the_templates_business(tiny: Tokenizer) -> None:
    # Llama 3 without one writes its own (with strftime_now), Gemma folds it into the first user turn
    llama = ChatTemplate(LLAMA3, "llama3", (("bos_token", "<|begin_of_text|>"),))
    text = render_text(llama, CONVERSATION[1:])
    assert text == oracle(hf(tiny, LLAMA3, bos_token="<|begin_of_text|>"), CONVERSATION[1:])[0]
    assert "system<|end_header_id|>\n\nToday is 20" in text
    gemma = ChatTemplate(GEMMA, "gemma", (("bos_token", "<bos>"),))
    prompt = render_chat(gemma, tiny, CONVERSATION)
    assert (prompt.text, list(prompt.ids)) == oracle(hf(tiny, GEMMA, bos_token="<bos>"), CONVERSATION)
    assert prompt.text.startswith("<bos><start_of_turn>user\nYou are terse. Answer in one word.\n\nHi there!")
    assert prompt.stop_ids == (tiny.token_id("<|endoftext|>"), tiny.token_id("<end_of_turn>"))


def test_raise_exception_is_a_one_line_typed_error(tiny: Tokenizer) -> None:
    template = ChatTemplate(LLAMA3, "llama3-file")
    with pytest.raises(ChatTemplateError, match=r"^the chat template of llama3-file failed: Conversation roles must "
                       r"alternate user/assistant/user/assistant/\.\.\.$") as info:
        render_chat(template, tiny, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert isinstance(info.value, ModelError) and "\n" not in str(info.value)


@pytest.mark.parametrize("source, message", [
    ("{% for m in messages %}{{ m.content }", "does not compile: unexpected '}'"),
    ("{{ messages[0].content.__class__.__mro__ }}", "failed: access to attribute '__class__'"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns }}", "failed: a namespace cannot hold underscore names"),
    ("{{ messages[0]['content'] + 1 }}", "failed: can only concatenate str"),
    ("{{ messages.append(1) }}", "failed: access to attribute 'append' of 'list' object is unsafe"),
])
def test_templates_that_fail_give_chat_template_errors(source: str, message: str, tiny: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match=message) as info:
        render_chat(ChatTemplate(source, "t"), tiny, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def test_a_template_that_renders_nothing_or_bad_messages(tiny: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="rendered nothing for 1 message"):
        render_chat(ChatTemplate("{% if false %}x{% endif %}", "t"), tiny, [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="message 1 is not a mapping with a string 'role'"):
        render_text(ChatTemplate("x", "t"), [{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ChatTemplateError, match="must be a list"):
        render_text(ChatTemplate("x", "t"), "hello")  # type: ignore[arg-type]


def test_none_values_are_dropped_as_transformers_drops_them(tiny: Tokenizer) -> None:
    source = "{% for m in messages %}{{ m.role }}={{ m.content if 'content' in m else 'EMPTY' }};{% endfor %}"
    messages = [{"role": "user", "content": None}, {"role": "assistant", "content": "x", "tool_calls": None}]
    assert render_text(ChatTemplate(source, "t"), messages) == oracle(hf(tiny, source), messages)[0]
    assert render_text(ChatTemplate(source, "t"), messages) == "user=EMPTY;assistant=x;"


def test_a_model_without_a_template_gets_plain_lines(tiny: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    template = load_chat_template(tmp_path)
    assert template.is_plain and template.special("eos_token") == "<|endoftext|>"
    assert template.warning is not None and tmp_path.name in template.warning and "no chat template" in template.warning
    prompt = render_chat(template, tiny, CONVERSATION[:2])
    assert prompt.text == "system: You are terse. Answer in one word.\nuser: Hi there! What's 2+2?\nassistant:"
    assert list(prompt.ids) == tiny.encode(prompt.text)
    assert prompt.stop_ids == (tiny.token_id("<|endoftext|>"),)
    assert PLAIN.is_plain and ChatTemplate("x", "m").warning is None


def test_load_from_an_hf_directory(tmp_path: Path) -> None:
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
              "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<other>", "pad_token": "<pad>"}))
    t = load_chat_template(tmp_path)
    assert t.source == "D" and dict(t.special_tokens) == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}")  # the file wins, as in transformers
    assert render_text(load_chat_template(tmp_path), [{"role": "user", "content": "x"}]) == "J<s>"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(CheckpointError, match="none named 'default'"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_chat_template(tmp_path)
    with pytest.raises(CheckpointError, match="neither a checkpoint directory nor a .gguf file"):
        load_chat_template(tmp_path / "missing")


def test_gguf_metadata_template_and_special_tokens() -> None:
    meta = {"tokenizer.chat_template": "{{ eos_token }}", "tokenizer.ggml.tokens": ["<a>", "<b>", "c"],
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.bos_token_id": 0}
    t = ChatTemplate.from_gguf_metadata(meta, "m.gguf")
    assert t.source == "{{ eos_token }}" and dict(t.special_tokens) == {"bos_token": "<a>", "eos_token": "<b>"}
    with pytest.raises(CheckpointError, match="outside the vocabulary"):
        ChatTemplate.from_gguf_metadata({**meta, "tokenizer.ggml.eos_token_id": 3}, "m.gguf")
    assert ChatTemplate.from_gguf_metadata({}, "m.gguf").is_plain


def test_stop_ids_find_the_turn_end_the_template_writes(tiny: Tokenizer) -> None:
    # a turn end that is none of the usual names is found by rendering an assistant message
    source = "{% for m in messages %}<|im_start|>{{ m.content }}<|pad|>{% endfor %}"
    assert stop_ids(ChatTemplate(source, "t"), tiny) == (tiny.token_id("<|endoftext|>"), tiny.token_id("<|pad|>"))
    assert stop_ids(ChatTemplate("{{ raise_exception('no') }}", "t"), tiny) == (tiny.token_id("<|endoftext|>"),)


def test_trim_to_fit_drops_the_oldest_turns_and_keeps_the_system_message(tiny: Tokenizer) -> None:
    template = ChatTemplate(LLAMA3, "llama3", (("bos_token", "<|begin_of_text|>"),))
    turns = [CONVERSATION[0]]
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": f"answer {i}"}]
    turns.append({"role": "user", "content": "last question"})
    full = render_chat(template, tiny, turns)
    prompt, dropped = trim_to_fit(template, tiny, turns, len(full.ids))
    assert (prompt, dropped) == (full, 0)
    keep = [turns[0], *turns[-3:]]
    limit = len(render_chat(template, tiny, keep).ids)
    prompt, dropped = trim_to_fit(template, tiny, turns, limit)
    assert dropped == len(turns) - 4 and prompt == render_chat(template, tiny, keep)  # alternation kept: it rendered
    with pytest.raises(CapacityError, match=r"the prompt needs \d+ tokens, more than the 5 this conversation"):
        trim_to_fit(template, tiny, turns, 5)
