"""Shaping one choice of a response, whole (non-streamed) or chunk by chunk (streamed).

Completions: the text (with `echo`, the prompt first), and with `logprobs` OpenAI's legacy logprobs
object (prompt tokens too when echoing; max_tokens=0 with echo returns only the prompt's). Chat: the
message (content, or tool calls parsed from the model's `<tool_call>` blocks, server/tools.py) and
with `logprobs` the chat logprobs object. A streamed chunk's logprobs cover the tokens generated since
the previous chunk; a streamed tool call is sent whole, in one delta, once the model has finished
(the same parse as the non-streamed answer, so both always agree).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specfleet.engine.async_engine import RequestStream
from specfleet.outputs import RequestOutput
from specfleet.sampling_params import SamplingParams
from specfleet.server import serving, tools
from specfleet.server.schemas import ChatCompletionRequest, CompletionRequest

@dataclass
class Choice:
    """One choice of a response: its own engine request."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    prompt_text: str | None = None  # the prompt as text, for a completion's echo


# (fields of the chunk's choice, whether it is the choice's final chunk, finish_reason override)
Chunk = tuple[dict[str, Any], bool, "str | None"]


class CompletionShape:
    def __init__(self, req: CompletionRequest, texts: serving.TokenText):
        self.req, self.texts = req, texts
        # echo with max_tokens=0 runs one token (the engine always makes one) and leaves it out
        self.skip_tokens = 1 if req.echo and req.max_tokens == 0 else 0

    def generated(self, out: RequestOutput) -> tuple[str, list[int]]:
        if self.skip_tokens:
            return "", []
        return out.text, out.token_ids

    def prompt_logprobs(self, c: Choice, out: RequestOutput) -> dict[str, Any]:
        return serving.completion_logprobs(self.texts, out.prompt_logprobs or [], c.prompt_token_ids, 0)

    def final(self, c: Choice, out: RequestOutput) -> serving.ChoiceOut:
        text, ids = self.generated(out)
        logprobs = None
        if self.req.logprobs is not None:
            entries, all_ids = list((out.logprobs or [])[:len(ids)]), list(ids)
            if self.req.echo:
                entries, all_ids = [*(out.prompt_logprobs or []), *entries], [*c.prompt_token_ids, *all_ids]
            logprobs = serving.completion_logprobs(self.texts, entries, all_ids, 0)
        if self.req.echo:
            text = (c.prompt_text or "") + text
        return serving.ChoiceOut(c.index, out, {"text": text, "logprobs": logprobs}, out.finish_reason)

    def stream_state(self, c: Choice) -> CompletionStream:
        return CompletionStream(self, c)


class CompletionStream:
    def __init__(self, shape: CompletionShape, c: Choice):
        self.shape, self.c = shape, c
        self.deltas = serving.DeltaText(c.params.stop)
        self.skip_tokens = shape.skip_tokens
        self.echoed = not shape.req.echo
        self.num_scored = 0  # generated tokens whose logprobs were sent
        self.offset = 0  # text_offset of the next token

    def chunks(self, out: RequestOutput) -> list[Chunk]:
        req, got = self.shape.req, []
        if not self.echoed:  # the prompt goes first, in a chunk of its own
            self.echoed = True
            lp = None
            if req.logprobs is not None:
                lp = self.shape.prompt_logprobs(self.c, out)
                self.offset = sum(len(t) for t in lp["tokens"])
            got.append(({"text": self.c.prompt_text or "", "logprobs": lp}, False, None))
        text, ids = self.shape.generated(out)
        delta = self.deltas.delta_of(text, out.finished)
        if delta or out.finished:
            lp = None
            if req.logprobs is not None:
                new = slice(self.num_scored, len(ids))
                lp = serving.completion_logprobs(self.shape.texts, (out.logprobs or [])[new], ids[new], self.offset)
                self.offset += sum(len(t) for t in lp["tokens"])
                self.num_scored = len(ids)
            got.append(({"text": delta, "logprobs": lp}, out.finished, None))
        return got


class ChatShape:
    def __init__(self, req: ChatCompletionRequest, texts: serving.TokenText, parse_tools: bool):
        self.req, self.texts, self.parse_tools = req, texts, parse_tools
        self.tool_names = frozenset(t.function.name for t in req.tools or []) if parse_tools else frozenset()
        self.skip_tokens = 0

    def tool_calls(self, text: str) -> tuple[str | None, list[tools.ToolCall]]:
        if not self.parse_tools:
            return text, []
        content, calls = tools.parse_tool_calls(text, self.tool_names)
        if calls and not self.req.parallel_tool_calls:
            calls = calls[:1]
        return content, calls

    @staticmethod
    def finish_reason(out: RequestOutput, calls: list) -> str | None:
        return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason

    def logprobs(self, out: RequestOutput, new: slice = slice(None)) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return serving.chat_logprobs(self.texts, (out.logprobs or [])[new])

    def final(self, c: Choice, out: RequestOutput) -> serving.ChoiceOut:
        content, calls = self.tool_calls(out.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return serving.ChoiceOut(c.index, out, {"message": message, "logprobs": self.logprobs(out)},
                                 self.finish_reason(out, calls))

    def stream_state(self, c: Choice) -> ChatStream:
        return ChatStream(self, c)


class ChatStream:
    def __init__(self, shape: ChatShape, c: Choice):
        self.shape, self.c = shape, c
        self.deltas = serving.DeltaText(c.params.stop)
        self.skip_tokens = 0
        self.num_scored = 0

    def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        lp = self.shape.logprobs(out, slice(self.num_scored, len(out.token_ids)))
        self.num_scored = len(out.token_ids)
        return lp

    def chunks(self, out: RequestOutput) -> list[Chunk]:
        text = out.text
        if not self.shape.parse_tools:
            delta = self.deltas.delta(out)
            if delta or out.finished:
                return [({"delta": {"content": delta}, "logprobs": self._logprobs(out)}, out.finished, None)]
            return []
        start = text.find(tools.TOOL_CALL_START)
        if not out.finished:
            # content before a call is final; a possible start of one is held back; the call waits for the
            # end, and so does a message that may be a bare call
            if start >= 0:
                delta = self.deltas.delta_of(text[:start], True)
            elif self.deltas.sent == "" and tools.may_be_bare_call(text):
                delta = ""
            else:
                delta = self.deltas.delta_of(text, False, hold=tools.tool_call_prefix_len(text))
            return [({"delta": {"content": delta}, "logprobs": self._logprobs(out)}, False, None)] if delta else []
        _, calls = self.shape.tool_calls(text)
        if not calls:
            delta = self.deltas.delta_of(text, True)
            return [({"delta": {"content": delta}, "logprobs": self._logprobs(out)}, True, None)]
        got: list[Chunk] = []
        delta = self.deltas.delta_of(text[:start], True) if start >= 0 else ""
        tail = tools.split_tool_calls(text, self.shape.tool_names)[2] if start >= 0 else ""
        if tail:  # a last call cut off (max_tokens): its text is content, after the content before the calls
            delta = (delta.rstrip() + "\n" if delta.strip() else "") + tail
        if delta:
            got.append(({"delta": {"content": delta}, "logprobs": None}, False, None))
        got.append(({"delta": {"tool_calls": [call.as_openai(i) for i, call in enumerate(calls)]},
                     "logprobs": self._logprobs(out)}, True, self.shape.finish_reason(out, calls)))
        return got
