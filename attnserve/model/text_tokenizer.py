"""A language model's tokenizer: Hugging Face `tokenizers` (tokenizer.json) and its chat template.

A decoder-only model directory holds ``tokenizer.json`` (any model the `tokenizers` library
runs: byte-level BPE, SentencePiece-style BPE, Unigram) and ``tokenizer_config.json`` in Hugging
Face's format (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, ``add_bos_token``,
``chat_template``). Special tokens added at encode time come from tokenizer.json's
post-processor, as in transformers' fast tokenizers.

The chat template is Jinja, rendered as transformers renders it (`apply_chat_template`): a
sandboxed, immutable environment (a template cannot reach Python attributes or change its
inputs), `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, `raise_exception`,
`strftime_now` and transformers' `tojson`. Bad messages and templates that refuse them raise
`ChatTemplateError` (a ValueError: the service answers 422).

Tools are passed as transformers passes them (`apply_chat_template(tools=...)`: a list of
`{"type": "function", "function": {...}}`, `tools=None` without), with assistant messages that
carry `tool_calls` (`function.arguments` a dict, as vLLM hands them to Hugging Face templates)
and `role: "tool"` results. `renders_tools` says whether the template has a tools section at
all (it reads the `tools` variable); the service writes its own tool prompt for one that does
not (service/tool_prompt.py).

What a client sends is data (control_tokens.py): a chat's control tokens (tokenizer.json's
special tokens) are those its template writes, never text from the messages, tools or
template variables; `encode(special=False)` reads none in a text either.

Imports no torch: the service runs it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from attnserve.model.control_tokens import (
    ControlTokens,
    TokenBytes,
    affixes,
    check_prefix,
    encode,
    longest_token_bytes,
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# Special tokens that end an assistant turn in chat templates (the ones that appear in the
# model's template count; EOS always does).
END_OF_TURN = re.compile(r"end|eot|eos|</s>", re.IGNORECASE)


# Variables the rendering sets itself, which chat_template_kwargs may not replace.
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)
# `limit`: a text of more than this many characters a token is first counted on a prefix of
# that length, and refused when the prefix alone holds more than the limit plus the margin.
PREFIX_CHARS_PER_TOKEN = 8
PREFIX_MARGIN = 64


class ChatTemplateError(ValueError):
    """Messages the chat template cannot render, or a template that refuses them."""


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=1)
def _environment() -> Any:
    """transformers' sandboxed environment for chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # transformers' filter: unlike jinja's own, it does not escape HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The template compiled in transformers' sandboxed environment."""
    from jinja2.exceptions import TemplateError

    try:
        return _environment().from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


@lru_cache(maxsize=16)
def template_reads(template: str, name: str) -> bool:
    """Whether the template reads the variable `name` from its context (not one it only sets
    itself; comments and strings do not count). False for a template that does not compile."""
    from jinja2 import meta
    from jinja2.exceptions import TemplateError

    try:
        return name in meta.find_undeclared_variables(_environment().parse(template))
    except TemplateError:
        return False


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A list of {"role": str, "content": str} dicts (other keys kept), or ChatTemplateError.
    An assistant's `tool_calls`: a non-empty list of {"function": {"name": str, "arguments":
    dict or str}}; a tool result's `tool_call_id` (where given): a string."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] is not an object")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        if not isinstance(message.get("content"), str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")
        if "tool_calls" in message:
            _check_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        if "tool_call_id" in message and not isinstance(message["tool_call_id"], str):
            raise ChatTemplateError(f"messages[{i}].tool_call_id must be a string")
        checked.append(dict(message))
    return checked


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, Sequence) or isinstance(calls, str) or not calls:
        raise ChatTemplateError(f"{where} must be a non-empty list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"{where}[{j}].function must be an object with a name")
        if not isinstance(function.get("arguments"), (Mapping, str)):
            raise ChatTemplateError(f"{where}[{j}].function.arguments must be an object")


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """A list of {"type": "function", "function": {"name": str, ...}} dicts, or
    ChatTemplateError."""
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ChatTemplateError("tools must be a list of objects")
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"tools[{i}].function must be an object with a name")
        checked.append(dict(tool))
    return checked


class TextTokenizer:
    """Encode, decode and render chats for a language model."""

    def __init__(self, tokenizer: HFTokenizer, config: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = dict(config or {})
        self.special = {name: _token_content(self.config.get(name)) for name in SPECIAL_NAMES}
        self.chat_template: str | None = self.config.get("chat_template") or None

    # -- files -------------------------------------------------------------------------------

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        """tokenizer.json and tokenizer_config.json of a model directory (FileNotFoundError
        naming the missing file)."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the model has no language-model tokenizer")
        config: dict[str, Any] = {}
        config_path = directory / TOKENIZER_CONFIG_FILE
        if config_path.is_file():
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError(f"{config_path} is not a JSON object")
            config = loaded
        template = directory / "chat_template.jinja"  # transformers 5 keeps it apart
        if not config.get("chat_template") and template.is_file():
            config["chat_template"] = template.read_text(encoding="utf-8")
        return cls(HFTokenizer.from_file(str(path)), config)

    def save(self, directory: str | Path) -> list[Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / TOKENIZER_FILE))
        config_path = directory / TOKENIZER_CONFIG_FILE
        text = json.dumps(self.config, indent=2, ensure_ascii=False, sort_keys=True)
        config_path.write_text(text + "\n", encoding="utf-8")
        return [directory / TOKENIZER_FILE, config_path]

    # -- ids ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The text a token id stands for (decoded, special tokens included)."""
        return str(self.tokenizer.decode([int(token_id)], skip_special_tokens=False))

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """The bytes of text each token stands for (part of a character for some tokens)."""
        return TokenBytes(self.tokenizer)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's token string of each id, as stored (transformers'
        convert_ids_to_tokens: byte-level BPE's "Ġthe"); "" outside the vocabulary."""
        return [self.tokenizer.id_to_token(int(i)) or "" for i in ids]

    @property
    def bos_id(self) -> int | None:
        return self.token_to_id(self.special["bos_token"])

    @property
    def eos_id(self) -> int | None:
        return self.token_to_id(self.special["eos_token"])

    @property
    def pad_id(self) -> int | None:
        return self.token_to_id(self.special["pad_token"])

    @property
    def stop_ids(self) -> list[int]:
        """EOS, and the special tokens the chat template writes that end a turn (e.g.
        `<|im_end|>`, `<|eot_id|>`): generation stops at any of them."""
        ids: list[int | None] = [self.eos_id]
        template = self.chat_template or ""
        for added in self.tokenizer.get_added_tokens_decoder().values():
            content = added.content
            if added.special and content in template and END_OF_TURN.search(content):
                ids.append(self.token_to_id(content))
        return sorted({i for i in ids if i is not None})

    @cached_property
    def control(self) -> ControlTokens:
        """The control tokens (special tokens) and the encodings that keep text from them."""
        return ControlTokens(self.tokenizer)

    @cached_property
    def max_token_bytes(self) -> int:
        """At most how many UTF-8 bytes of text one token stands for."""
        return longest_token_bytes(self.tokenizer)

    def prepare(self) -> None:
        """Build now what the first request that needs it would build (a server loads its
        models on a worker thread): the tokenizer copy that reads special tokens' text as text,
        and `max_token_bytes`."""
        self.control.plain()
        _ = self.max_token_bytes

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        special: bool = True,
        limit: int | None = None,
    ) -> list[int]:
        """Token ids; `add_special_tokens`: what the tokenizer adds around a text (BOS);
        `special`: a special token's text in `text` is that token (transformers' default)
        or, False, the characters it is made of; `limit`: TokenLimitExceeded, before the
        whole text is encoded, when a prefix of it is already past that many tokens."""
        if limit is not None:
            self.check_length(text, limit)
        if not special:
            return self.control.encode_text(text, add_special_tokens)
        return list(encode(self.tokenizer, text, add_special_tokens).ids)

    def check_length(self, text: str, limit: int) -> None:
        """TokenLimitExceeded when a prefix of a long text alone holds more than `limit`
        tokens (with a margin for the cut): an early stop, not the exact count."""
        check_prefix(self.tokenizer, text, limit, PREFIX_CHARS_PER_TOKEN, PREFIX_MARGIN)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- chat --------------------------------------------------------------------------------

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template has a tools section (it reads `tools`)."""
        return bool(self.chat_template) and template_reads(self.chat_template or "", "tools")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat rendered as the model's template writes it (transformers' rendering:
        `tools` and `documents` are None unless given); `continue_final_message`: cut after
        the last message's content, so the model goes on with it (transformers' rule, and its
        refusal of a template that does not show it); `template_kwargs`: further variables
        of the template, as transformers' `apply_chat_template(**kwargs)` passes them (Qwen3's
        `enable_thinking`), never one of the names the rendering sets itself."""
        from jinja2.exceptions import TemplateError

        if not self.chat_template:
            raise ChatTemplateError("the model has no chat template: send a prompt (text)")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt exclude each other"
            )
        extra = dict(template_kwargs or {})
        taken = sorted(set(extra) & RESERVED_VARIABLES)
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)}")
        checked = check_messages(messages)
        tool_list = None if tools is None else check_tools(tools)
        variables = {name: value for name, value in self.special.items() if value is not None}
        try:
            rendered = str(
                _compile(self.chat_template).render(
                    messages=checked,
                    tools=tool_list,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **{**variables, **extra},
                )
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # raise_exception(...) in the template, a sandbox stop, or the template's own error
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
        if not continue_final_message:
            return rendered
        content = checked[-1].get("content")
        final = content if isinstance(content, str) else ""
        at = rendered.rfind(final.strip())
        if at < 0:
            raise ChatTemplateError(
                "continue_final_message: the chat template does not show the last message"
            )
        if rendered[at : at + len(final.lstrip())] == final:  # the template kept its spacing
            return rendered[: at + len(final.lstrip())]
        return rendered[: at + len(final.strip())]

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens, so none
        are added unless asked (as transformers' apply_chat_template(tokenize=True)). Only
        the template's special tokens are control tokens: their text in the messages, tools
        or template variables is encoded as text (control_tokens.py; a chat without any is
        encoded as transformers encodes it). `limit`: as `encode`'s."""
        rendered = self.apply_chat_template(
            messages, add_generation_prompt, tools, continue_final_message, template_kwargs
        )
        if limit is not None:
            self.check_length(rendered, limit)
        data = {"messages": list(messages), "tools": tools, "kwargs": template_kwargs}
        marked = self.control.mark(data, self.chat_template or "")
        if marked is None:
            return list(encode(self.tokenizer, rendered, add_special_tokens).ids)
        shown = self.apply_chat_template(
            marked.data["messages"],
            add_generation_prompt,
            marked.data["tools"],
            continue_final_message,
            marked.data["kwargs"],
        )
        if marked.restore(shown) != rendered:
            raise ChatTemplateError(
                f"the chat template treats text holding the special token {marked.texts[0]!r} "
                "differently from other text, so it cannot be kept as text: leave it out"
            )
        ids = self.control.encode_marked(shown, marked)
        if not add_special_tokens:
            return ids
        before, after = affixes(self.tokenizer)
        return [*before, *ids, *after]

    def added_tokens(self, special_only: bool = False) -> dict[str, int]:
        """Added tokens (the vocabulary's control and marker tokens): text -> id."""
        return {
            added.content: int(i)
            for i, added in self.tokenizer.get_added_tokens_decoder().items()
            if added.special or not special_only
        }

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab={self.vocab_size}, chat_template={bool(self.chat_template)})"
