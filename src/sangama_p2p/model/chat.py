"""Chat templates from the checkpoint itself, rendered exactly as transformers renders them.

A chat model is trained on conversations laid out one way (``<|im_start|>user ...<|im_end|>``, Llama 3's
``<|start_header_id|>``, Gemma's ``<start_of_turn>``...) and ships that layout as a Jinja template: in a GGUF file's
``tokenizer.chat_template`` metadata, in an HF directory's ``chat_template.jinja`` or in ``tokenizer_config.json``'s
``chat_template``. :func:`load_chat_template` reads it (the only I/O here); :func:`render_chat` turns messages into
the prompt's token ids::

    template = load_chat_template("SmolLM2-135M-Instruct.Q4_1.gguf")   # or a checkpoint directory
    prompt = render_chat(template, tokenizer, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}])
    prompt.ids, prompt.text, prompt.stop_ids

Rendering follows ``transformers.utils.chat_template_utils`` (5.x), so that the ids equal
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``: an
``ImmutableSandboxedEnvironment`` (templates are untrusted code from the Hub) with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and a pass-through ``{% generation %}`` block, the
``raise_exception`` / ``strftime_now`` globals, a ``tojson`` filter that does not HTML-escape, ``dict`` and a
``namespace`` that refuses underscore names; the variables ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ...). The rendered text is encoded
without adding special tokens, and special tokens written in the text are encoded as those tokens (as transformers
does unless ``sanitize_control_tokens`` is asked for).

A checkpoint without a template gets :data:`PLAIN` - ``role: content`` lines and a final ``assistant:`` - and
:attr:`ChatTemplate.warning` says so; callers print it once.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import ChatTemplateError, CheckpointError, translate

__all__ = [
    "END_OF_TURN_TOKENS",
    "PLAIN",
    "ChatPrompt",
    "ChatTemplate",
    "load_chat_template",
    "render_chat",
    "render_text",
    "stop_ids",
    "trim_to_fit",
]

# special-token names as transformers' ``special_tokens_map`` has them, and the GGUF metadata key of each id
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GGUF_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "sep_token": "seperator_token_id", "pad_token": "padding_token_id", "cls_token": "cls_token_id",
             "mask_token": "mask_token_id"}  # fmt: skip  ("seperator": llama.cpp's spelling)
# tokens that end a turn in the templates people use; a stop token when the template writes it and the vocabulary
# has it (the turn end found by rendering an assistant message is added to these, see :func:`stop_ids`)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|END_OF_TURN_TOKEN|>",
                      "<|return|>", "<|end_of_turn|>", "<|endofturn|>")
_PROBE = "\x00sangama-probe\x00"


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template: the Jinja ``source`` (None: the checkpoint has none, the plain fallback), where
    it came from (``origin``, for messages) and the special tokens the template sees as variables."""

    source: str | None
    origin: str
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text), e.g. ("eos_token", "<|im_end|>")

    @property
    def is_plain(self) -> bool:
        return self.source is None

    @property
    def warning(self) -> str | None:
        """What to tell the user (once) when the checkpoint has no template, else None."""
        if self.source is not None:
            return None
        return (f"{self.origin} has no chat template: prompts are plain 'role: content' lines, which a chat model "
                "was not trained on")

    def special(self, name: str) -> str | None:
        return dict(self.special_tokens).get(name)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], origin: str) -> ChatTemplate:
        """From GGUF metadata: ``tokenizer.chat_template``, special tokens from ``tokenizer.ggml.*_token_id``."""
        source = metadata.get("tokenizer.chat_template")
        if source is not None and not isinstance(source, str):
            raise CheckpointError(f"{origin}: tokenizer.chat_template is not a string")
        tokens = metadata.get("tokenizer.ggml.tokens")
        specials = []
        for name in _SPECIAL_NAMES:
            i = metadata.get(f"tokenizer.ggml.{_GGUF_IDS[name]}")
            if i is None or not isinstance(tokens, list):
                continue
            if not 0 <= int(i) < len(tokens):
                raise CheckpointError(f"{origin}: tokenizer.ggml.{_GGUF_IDS[name]} {i} lies outside the vocabulary")
            specials.append((name, str(tokens[int(i)])))
        return cls(source, origin, tuple(specials))

    @classmethod
    def from_hf_files(cls, tokenizer_config: Mapping[str, Any] | None, jinja: str | None,
                      special_tokens_map: Mapping[str, Any] | None, origin: str) -> ChatTemplate:
        """From an HF directory's files (already read): ``chat_template.jinja`` wins over ``tokenizer_config.json``'s
        ``chat_template`` (a string, or a list of ``{name, template}`` of which ``default`` is taken), as in
        transformers; special tokens from ``tokenizer_config.json``, else ``special_tokens_map.json``."""
        tcfg = dict(tokenizer_config or {})
        source = jinja
        if source is None:
            raw = tcfg.get("chat_template")
            if isinstance(raw, list):  # the older form of several named templates
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
                raw = named.get("default")
                if raw is None and named:
                    raise CheckpointError(f"{origin}: several chat templates ({', '.join(map(str, named))}) and "
                                          "none named 'default'")
            if raw is not None and not isinstance(raw, str):
                raise CheckpointError(f"{origin}: chat_template is not a string")
            source = raw
        specials = []
        for name in _SPECIAL_NAMES:
            value = tcfg.get(name, (special_tokens_map or {}).get(name))
            if isinstance(value, Mapping):  # an AddedToken written out: {"content": ..., "special": ...}
                value = value.get("content")
            if isinstance(value, str):
                specials.append((name, value))
        return cls(source, origin, tuple(specials))


PLAIN = ChatTemplate(None, "the model")


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: the prompt's token ids, its text, and the ids that end the model's answer."""

    ids: tuple[int, ...]
    text: str
    stop_ids: tuple[int, ...]


# ---- the one I/O edge ------------------------------------------------------------------------------------------
def load_chat_template(path: str | Path) -> ChatTemplate:
    """The chat template of a checkpoint: a ``.gguf`` file or an HF directory (the plain fallback when it has none)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from .gguf.reader import read_metadata

        return ChatTemplate.from_gguf_metadata(read_metadata(p).metadata, p.name)
    if not p.is_dir():
        raise CheckpointError(f"{p} is neither a checkpoint directory nor a .gguf file")
    jinja = _read_text(p / "chat_template.jinja")
    return ChatTemplate.from_hf_files(_read_json(p / "tokenizer_config.json"), jinja,
                                      _read_json(p / "special_tokens_map.json"), p.name)


def _read_text(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise translate(exc, CheckpointError, f"cannot read {path}")


def _read_json(path: Path) -> dict[str, Any] | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise translate(exc, CheckpointError, f"cannot read {path}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


# ---- rendering (pure) -------------------------------------------------------------------------------------------
def render_text(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` gives it.

    ``messages``: mappings with a string ``role`` and a ``content``; keys whose value is None are dropped (as
    transformers does). ``tools``: OpenAI-shaped tool definitions for a template that lays them out
    (:mod:`sangama_p2p.model.tool_calls` prepares them). Raises :class:`ChatTemplateError` (one line) when the
    template does not compile or render, ``raise_exception`` included.
    """
    chat = _plain_messages(messages)
    if template.source is None:
        lines = [f"{m['role']}: {m.get('content', '')}\n" for m in chat]
        return "".join(lines) + ("assistant:" if add_generation_prompt else "")
    compiled = _compile(template.source, template.origin)
    try:
        return compiled.render(messages=chat, tools=[_plain(t) for t in tools] if tools else None, documents=None,
                               add_generation_prompt=add_generation_prompt, **dict(template.special_tokens))
    except Exception as exc:  # a template is foreign code: whatever it raises is the template's failure
        raise ChatTemplateError(f"the chat template of {template.origin} failed: {_one_line(exc)}") from exc


def render_chat(template: ChatTemplate, tokenizer: Any, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None) -> ChatPrompt:
    """Messages -> the prompt's token ids, its text and the stop ids (see :func:`render_text`, :func:`stop_ids`).

    ``tokenizer``: a :class:`~sangama_p2p.model.tokenizer.Tokenizer` (its ``encode`` adds no special tokens and
    matches special tokens in the text). Used by ``chat``, ``generate --local --chat`` and, later, the HTTP API.
    """
    text = render_text(template, messages, add_generation_prompt=add_generation_prompt, tools=tools)
    if not text:
        raise ChatTemplateError(f"the chat template of {template.origin} rendered nothing for {len(messages)} "
                                "message(s)")
    return ChatPrompt(tuple(tokenizer.encode(text)), text, stop_ids(template, tokenizer))


def trim_to_fit(template: ChatTemplate, tokenizer: Any, messages: Sequence[Mapping[str, Any]], limit: int, *,
                add_generation_prompt: bool = True) -> tuple[ChatPrompt, int]:
    """Render ``messages`` into at most ``limit`` ids, dropping the oldest turns first; ``(prompt, messages dropped)``.

    A leading system message always stays; a turn is a user message with everything up to the next user message, so
    the conversation still alternates as templates demand. Raises :class:`CapacityError` when even the system
    message and the last turn do not fit.
    """
    from ..errors import CapacityError

    kept = list(messages)
    head = 1 if kept and kept[0].get("role") == "system" else 0
    while True:
        prompt = render_chat(template, tokenizer, kept, add_generation_prompt=add_generation_prompt)
        if len(prompt.ids) <= limit:
            return prompt, len(messages) - len(kept)
        users = [i for i in range(head, len(kept)) if kept[i].get("role") == "user"]
        if len(users) < 2:
            raise CapacityError(f"the prompt needs {len(prompt.ids)} tokens, more than the {limit} this conversation "
                                "may use; shorten the message (or the system prompt)")
        del kept[head:users[1]]


def stop_ids(template: ChatTemplate, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end an answer: the tokenizer's eos ids, the template's ``eos_token``, the special token the
    template writes right after an assistant message (found by rendering one), and the usual end-of-turn tokens
    (:data:`END_OF_TURN_TOKENS`) that the template's text names."""
    ids: list[int] = [int(i) for i in getattr(tokenizer, "eos_token_ids", ())]
    names: list[str] = []
    eos = template.special("eos_token")
    if eos is not None:
        names.append(eos)
    if template.source is not None:
        names.extend(t for t in END_OF_TURN_TOKENS if t in template.source)
        end = _turn_end(template, tokenizer)
        if end is not None:
            names.append(end)
    for name in names:
        i = tokenizer.token_id(name)
        if i is not None:
            ids.append(int(i))
    return tuple(dict.fromkeys(ids))


def _turn_end(template: ChatTemplate, tokenizer: Any) -> str | None:
    """The added token that directly follows an assistant message's content, when the template writes one."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render_text(template, probe, add_generation_prompt=False)
    except ChatTemplateError:  # a template that wants other turns (e.g. a system message first) tells nothing here
        return None
    at = text.find(_PROBE)
    if at < 0:
        return None
    tail = text[at + len(_PROBE):].lstrip(" ")
    backend = getattr(tokenizer, "backend", None)
    added = backend.get_added_tokens_decoder().values() if backend is not None else ()
    for content in sorted((t.content for t in added), key=len, reverse=True):
        if content and tail.startswith(content):
            return content
    return None


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dicts of JSON-like values (what the sandbox may see), None-valued keys dropped, roles checked."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} mappings")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} is not a mapping with a string 'role': {m!r:.80}")
        out.append({str(k): _plain(v) for k, v in m.items() if v is not None})
    return out


def _plain(value: Any) -> Any:
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"  # as transformers: an inert placeholder, never the object itself


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    line = getattr(exc, "lineno", None)
    return f"{text} (line {line})" if line else text


def _compile(source: str, origin: str) -> Any:
    try:
        return _compiled(source)
    except ChatTemplateError:
        raise
    except Exception as exc:  # TemplateSyntaxError and friends
        raise ChatTemplateError(f"the chat template of {origin} does not compile: {_one_line(exc)}") from exc


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    """The template compiled in the sandbox transformers uses (same options, globals and filters)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise ChatTemplateError(f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox escapes); this is "
                                f"{jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it passes through."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick (``namespace(self=...)``)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold underscore names ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)
