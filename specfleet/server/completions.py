"""POST /v1/completions: from the request to its choices' text, whole or streamed.

A choice's text (with `echo`, the prompt first) and with `logprobs` OpenAI's legacy logprobs object
(prompt tokens too when echoing; max_tokens=0 with echo returns only the prompt's). A streamed chunk's
logprobs cover the tokens generated since the previous chunk.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from specfleet.outputs import RequestOutput, TokenLogprob
from specfleet.server.context import Choice, ServerContext
from specfleet.server.responses import ChoiceOut, StreamState, TokenText, lp_value
from specfleet.server.schemas import DEFAULT_COMPLETION_TOKENS, CompletionRequest
from specfleet.server.streaming import Chunk, reply


async def completions(ctx: ServerContext, request: Request) -> Response:
    async def handle() -> Response:
        req = await ctx.parse(request, CompletionRequest, "completions")
        prompts = req.prompts()
        with ctx.admission.preparing(len(prompts) * req.n):
            for p in prompts:  # a prompt too long for the context is refused before it is tokenized
                if isinstance(p, str):
                    ctx.length_bound.check(p)
            ids = [await ctx.tokenize(lambda p=p: ctx.length_bound.encode(p, ctx.llm.encode)) for p in prompts]
            texts = [await ctx.tokenize(lambda p=p, i=i: prompt_text(ctx, p, i)) for p, i in zip(prompts, ids)] \
                if req.echo else None  # (decoding a token prompt is tokenizer work too: off the event loop)
            response_id, choices = await ctx.admit(ids, req, req.max_tokens, "cmpl", DEFAULT_COMPLETION_TOKENS,
                                                   texts, large=getattr(request.state, "large", False))
        return await reply(ctx, "completions", request, req, response_id, choices,
                           CompletionShape(req, ctx.token_text), "text_completion", "text_completion")
    return await ctx.run("completions", request, handle)


def prompt_text(ctx: ServerContext, prompt: str | list[int], ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return ctx.llm.tokenizer.decode(ids) if ctx.llm.tokenizer is not None else ""


def completion_logprobs(texts: TokenText, entries: list[TokenLogprob | None], token_ids: list[int],
                        offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs object for these tokens (what lm-evaluation-harness reads):
    per token its text, its log-probability (null for a prompt's first token), the most likely tokens
    with theirs (the token itself included, as vLLM does), and where its text starts in the choice's
    text (cumulative lengths of the tokens' texts, from `offset`)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, e in zip(token_ids, entries):
        t = texts.text(tid)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
        if e is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(lp_value(e.logprob))
            top = {texts.text(a): lp_value(lp) for a, lp in e.top}
            top.setdefault(t, lp_value(e.logprob))
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class CompletionShape:
    def __init__(self, req: CompletionRequest, texts: TokenText):
        self.req, self.texts = req, texts
        # echo with max_tokens=0 runs one token (the engine always makes one) and leaves it out
        self.skip_tokens = 1 if req.echo and req.max_tokens == 0 else 0

    def generated(self, out: RequestOutput) -> tuple[str, list[int]]:
        if self.skip_tokens:
            return "", []
        return out.text, out.token_ids

    def prompt_logprobs(self, c: Choice, out: RequestOutput) -> dict[str, Any]:
        return completion_logprobs(self.texts, out.prompt_logprobs or [], c.prompt_token_ids, 0)

    def final(self, c: Choice, out: RequestOutput) -> ChoiceOut:
        text, ids = self.generated(out)
        logprobs = None
        if self.req.logprobs is not None:
            entries, all_ids = list((out.logprobs or [])[:len(ids)]), list(ids)
            if self.req.echo:
                entries, all_ids = [*(out.prompt_logprobs or []), *entries], [*c.prompt_token_ids, *all_ids]
            logprobs = completion_logprobs(self.texts, entries, all_ids, 0)
        if self.req.echo:
            text = (c.prompt_text or "") + text
        return ChoiceOut(c.index, out, {"text": text, "logprobs": logprobs}, out.finish_reason)

    def stream_state(self, c: Choice) -> CompletionStream:
        return CompletionStream(self, c)


class CompletionStream(StreamState):
    def __init__(self, shape: CompletionShape, c: Choice):
        super().__init__(shape, c, shape.skip_tokens)
        self.echoed = not shape.req.echo
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
                lp = completion_logprobs(self.shape.texts, (out.logprobs or [])[new], ids[new], self.offset)
                self.offset += sum(len(t) for t in lp["tokens"])
                self.num_scored = len(ids)
            got.append(({"text": delta, "logprobs": lp}, out.finished, None))
        return got
