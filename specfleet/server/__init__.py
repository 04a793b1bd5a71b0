"""OpenAI-compatible HTTP server: `create_app(llm, ServerConfig)`; `specfleet serve` runs it."""
