"""Chat messages -> prompt token ids, with the server's template (--chat-template) and a request's
`chat_template_kwargs` (variables such as `enable_thinking` that some templates read).

Without either, this is exactly LLM.apply_chat_template, so a plain chat request gets the same prompt
as the offline API. With them it renders the same way (the tokenizer's own sandboxed Jinja, the
assistant's turn opened, no extra special tokens when encoding) with the override and the variables.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import jinja2

from specfleet.errors import InvalidRequestError, SpecfleetError
from specfleet.server import tools
from specfleet.server.schemas import UnsupportedError

if TYPE_CHECKING:
    from specfleet.llm import LLM


TEMPLATES = Path(__file__).parent / "templates"  # templates `--chat-template NAME` finds by name


def read_chat_template(path: str) -> str:
    """The template in `path` (or one shipped in server/templates, by name: `chatml-tools`), checked for
    Jinja syntax so that a broken file fails at startup."""
    shipped = TEMPLATES / f"{path.replace('-', '_')}.jinja"
    if not os.path.exists(path) and os.sep not in path and shipped.is_file():
        path = str(shipped)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SpecfleetError(f"cannot read --chat-template {path}: {e.strerror}") from e
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise SpecfleetError(f"--chat-template {path} is not a valid Jinja template: line {e.lineno}: "
                             f"{e.message}") from e
    return text


class ChatRenderer:
    def __init__(self, llm: LLM, template: str | None = None):
        self.llm, self.template = llm, template
        tokenizer = llm.tokenizer
        params = inspect.signature(tokenizer.apply_chat_template).parameters if tokenizer is not None else {}
        # names the tokenizer's apply_chat_template takes itself (or hands the template as `messages`):
        # a template variable of that name would collide with them instead of reaching the template
        self.reserved = {name for name, p in params.items() if p.kind is not p.VAR_KEYWORD} | {"messages"}

    @property
    def active_template(self) -> str | None:
        return self.template or getattr(self.llm.tokenizer, "chat_template", None)

    def tool_parser(self) -> str:
        """The tool-call syntax of the template (server/tools.py); a 400 when it is not one the server parses."""
        parser = tools.parser_for(self.active_template)
        if parser is None:
            raise UnsupportedError("tools", "this model's chat template does not use <tool_call> blocks (the Hermes / "
                                            "Qwen2.5 syntax), the only tool-call syntax this server parses so far")
        return parser

    def render(self, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None = None,
               add_generation_prompt: bool = True, tool_defs: list[dict[str, Any]] | None = None) -> list[int]:
        uses_tools = bool(tool_defs) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if self.template is None and not template_kwargs and add_generation_prompt and not uses_tools:
            return self.llm.apply_chat_template(messages)
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so it cannot chat; use /v1/completions with "
                                      "token ids")
        template = self.active_template
        if not template:
            raise InvalidRequestError("this model has no chat template; start the server with --chat-template "
                                      "FILE or use /v1/completions with a plain prompt")
        if uses_tools and not tools.template_knows_tools(template):
            # the template would drop the tools (or the calls in the history) without a word
            raise UnsupportedError("tools" if tool_defs else "messages",
                                   "this model's chat template does not render tools or tool calls; start the "
                                   "server with a --chat-template FILE that does (`--chat-template chatml-tools` "
                                   "for ChatML models such as SmolLM2)")
        clash = sorted(set(template_kwargs or {}) & self.reserved)
        if clash:
            raise UnsupportedError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)}: "
                                                           f"the server sets these itself")
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tool_defs,
                                                 add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        except (TypeError, ValueError) as e:  # e.g. `{{ n + 1 }}` with a string n: the request's values, not a bug
            if not template_kwargs:
                raise
            raise UnsupportedError("chat_template_kwargs", f"the chat template failed with these "
                                                           f"chat_template_kwargs: {e}") from e
        return tokenizer.encode(text, add_special_tokens=False)
