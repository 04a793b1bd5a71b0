"""The server's settings (`specfleet serve`'s options, cli/serve.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_queue: int = 256
    max_body_bytes: int = 2 << 20
    shutdown_timeout_s: float = 30.0
    api_key: str | None = None  # every route but /health then needs `Authorization: Bearer <key>`
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed by CORS ("*": any); none: no CORS headers
    chat_template: str | None = None  # a Jinja chat template replacing the model's own (--chat-template)
    # a stream's reader that leaves this many updates unread for this long is stopped (async_engine.py)
    stream_buffer: int = 64
    stream_stall_timeout_s: float = 30.0
    # a JSON schema keyword the grammar engine cannot enforce: "refuse" (400) or "relax" (generate under the
    # rest of the schema, said in the response) where the request leaves `strict` unsaid (runtime/sample/json_schema.py)
    unenforceable_schema: str = "refuse"
    # tokenizer / template / grammar work runs on these threads, off the event loop and the engine thread
    tokenizer_workers: int = 2
    # requests being prepared (tokenized, grammars compiled) at once; one more gets 429 before any work
    # (None: max_queue; requests being prepared also count against max_queue, server/admission.py)
    max_preparing: int | None = None
    # Host names served without an API key besides localhost, IPs and this machine's name ("*": any)
    allowed_hosts: tuple[str, ...] = ()
