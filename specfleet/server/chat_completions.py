"""POST /v1/chat/completions: from the request to its choices' messages, whole or streamed.

A choice's message is its content, or the tool calls parsed from the model's `<tool_call>` blocks
(server/tools.py), with `logprobs` the chat logprobs object. A streamed chunk's logprobs cover the
tokens generated since the previous chunk; a streamed tool call is sent whole, in one delta, once the
model has finished (the same parse as the non-streamed answer, so both always agree).
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from specfleet.outputs import RequestOutput, TokenLogprob
from specfleet.server import serving, tools
from specfleet.server.context import Choice, ServerContext
from specfleet.server.responses import ChoiceOut, StreamState, TokenText, lp_value
from specfleet.server.schemas import ChatCompletionRequest
from specfleet.server.streaming import Chunk, reply


async def chat_completions(ctx: ServerContext, request: Request) -> Response:
    async def handle() -> Response:
        llm, chat = ctx.llm, ctx.chat
        req = await ctx.parse(request, ChatCompletionRequest, "chat")
        messages, kwargs, tool_defs = req.template_messages(), req.chat_template_kwargs, req.active_tools()
        with ctx.admission.preparing(req.n):
            ctx.length_bound.check("\n".join(m["content"] for m in messages))  # the prompt holds all of these
            if req.tools and llm.tokenizer is not None:  # every tool's `parameters`, whatever tool_choice says
                await ctx.tokenize(lambda: serving.check_tool_parameters(req.tools, llm.engine.grammar_compiler()))
            ids = await ctx.tokenize(lambda: chat.render(messages, kwargs, tool_defs=tool_defs))
            parse_tools = tool_defs is not None and chat.tool_parser() is not None
            response_id, choices = await ctx.admit([ids], req, req.requested_max_tokens(), "chatcmpl",
                                                   large=getattr(request.state, "large", False))
        return await reply(ctx, "chat", request, req, response_id, choices,
                           ChatShape(req, ctx.token_text, parse_tools), "chat.completion", "chat.completion.chunk")
    return await ctx.run("chat", request, handle)


def chat_logprobs(texts: TokenText, entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat logprobs object: per token its text, bytes, log-probability and top_logprobs alternatives."""
    def item(tid: int, lp: float) -> dict[str, Any]:
        return {"token": texts.text(tid), "logprob": lp_value(lp), "bytes": texts.bytes(tid)}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(a, lp) for a, lp in e.top]}
                        for e in entries],
            "refusal": None}


class ChatShape:
    def __init__(self, req: ChatCompletionRequest, texts: TokenText, parse_tools: bool):
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
        return chat_logprobs(self.texts, (out.logprobs or [])[new])

    def final(self, c: Choice, out: RequestOutput) -> ChoiceOut:
        content, calls = self.tool_calls(out.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return ChoiceOut(c.index, out, {"message": message, "logprobs": self.logprobs(out)},
                                 self.finish_reason(out, calls))

    def stream_state(self, c: Choice) -> ChatStream:
        return ChatStream(self, c)


class ChatStream(StreamState):
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
