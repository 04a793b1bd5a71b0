"""vLLM's POST /tokenize and /detokenize: a prompt's token ids (or a chat request's), and ids' text."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from specfleet.server.context import ServerContext
from specfleet.server.errors import APIError
from specfleet.server.schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest


async def tokenize(ctx: ServerContext, request: Request) -> Response:
    """The token ids of a prompt, or of the prompt a chat request would get."""
    async def handle() -> Response:
        llm = ctx.llm
        body = await ctx.read_json(request)
        if _has_key(body, "messages"):
            chat_req = await ctx.parse(request, TokenizeChatRequest, "tokenize", body)
            messages, kwargs = chat_req.template_messages(), chat_req.chat_template_kwargs
            tool_defs = chat_req.active_tools()
            ids = await ctx.tokenize(lambda: ctx.chat.render(messages, kwargs, chat_req.add_generation_prompt,
                                                             tool_defs))
            want_strs = chat_req.return_token_strs
        else:
            req = await ctx.parse(request, TokenizeRequest, "tokenize", body)
            ids = await ctx.tokenize(lambda: encode(ctx, req.prompt, req.add_special_tokens))
            want_strs = req.return_token_strs
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_len, "tokens": ids}
        if want_strs:
            out["token_strs"] = llm.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)
    return await ctx.run("tokenize", request, handle)


async def detokenize(ctx: ServerContext, request: Request) -> Response:
    """The text of token ids, special tokens included (what the model sees)."""
    async def handle() -> Response:
        llm = ctx.llm
        req = await ctx.parse(request, DetokenizeRequest, "detokenize")
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so token ids cannot become text", param="tokens")
        bad = next((t for t in req.tokens if not 0 <= t < ctx.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{ctx.vocab - 1})", param="tokens")
        tokens = req.tokens
        # (not ctx.tokenize: a template error cannot happen here, and none is turned into a 400)
        text = await ctx.drain.race(asyncio.get_running_loop().run_in_executor(
            ctx.tokenizer_pool, lambda: llm.tokenizer.decode(tokens)))
        return JSONResponse({"prompt": text})
    return await ctx.run("detokenize", request, handle)


def encode(ctx: ServerContext, prompt: str, add_special_tokens: bool) -> list[int]:
    llm = ctx.llm
    if add_special_tokens or llm.tokenizer is None:
        return llm.encode(prompt)  # the prompt /v1/completions would get (or its "no tokenizer" error)
    return llm.tokenizer.encode(prompt, add_special_tokens=False)


def _has_key(body: bytes, key: str) -> bool:
    """Whether the JSON object in `body` has `key`; anything unparsable is left to the schema's error."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested arrays
        return False
    return isinstance(obj, dict) and key in obj
