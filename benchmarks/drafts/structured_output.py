"""Structured output with speculation: plain constrained decoding against constrained decoding with the
default speculation, without and with the grammar draft in front (drafting/forced_tokens.py).

N chat requests, each asking for a JSON object of one of a set of schemas (a person, an order, a weather
report, ...), greedy, one request at a time (batch 1), on one model loaded once. For every system and
request: the wall time, the tokens, the steps and the drafts (the grammar draft's drafted and accepted
tokens apart). Checks: every output that ended by itself (finish_reason "stop") is valid JSON for its
schema (`jsonschema` when installed, else the grammar engine's own check: the output's tokens are all
accepted and the grammar is complete), and the speculative systems' outputs equal plain decoding's token
for token. A warm-up request per system (not timed) builds the grammar engine's tokenizer view first.

    python benchmarks/drafts/structured_output.py --model qwen-1.5b --requests 50 --max-tokens 256
    python benchmarks/drafts/structured_output.py --model smollm2-135m-instruct --requests 4 --max-tokens 96   # smoke

Writes benchmarks/results/grammar-cpu-<time>.json and .md; exits 1 if an output is invalid for its
schema or differs from plain decoding.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STR = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": STR, "city": STR,
        "hobbies": {"type": "array", "items": STR, "maxItems": 4}}, "required": ["name", "age", "email", "city", "hobbies"]},
    "order": {"type": "object", "properties": {
        "order_id": STR, "customer": STR, "items": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"product": STR, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                             "unit_price": {"type": "number", "minimum": 0, "maximum": 10000}},
            "required": ["product", "quantity", "unit_price"]}},
        "express": {"type": "boolean"}}, "required": ["order_id", "customer", "items", "express"]},
    "weather": {"type": "object", "properties": {
        "city": STR, "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
        "forecast": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "day": {"type": "string", "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                                               "Sunday"]},
            "high_c": {"type": "integer", "minimum": -90, "maximum": 60}}, "required": ["day", "high_c"]}}},
        "required": ["city", "temperature_c", "conditions", "forecast"]},
    "book": {"type": "object", "properties": {
        "title": STR, "author": STR, "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
        "genres": {"type": "array", "items": STR, "maxItems": 3}, "isbn": STR,
        "rating": {"type": "number", "minimum": 0, "maximum": 5}}, "required": ["title", "author", "year", "genres",
                                                                               "isbn", "rating"]},
    "event": {"type": "object", "properties": {
        "name": STR, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "venue": STR,
        "attendees": {"type": "integer", "minimum": 0, "maximum": 100000},
        "speakers": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "name": STR, "topic": STR}, "required": ["name", "topic"]}}},
        "required": ["name", "date", "venue", "attendees", "speakers"]},
    "product": {"type": "object", "properties": {
        "sku": STR, "name": STR, "price": {"type": "number", "minimum": 0, "maximum": 100000},
        "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": STR, "maxItems": 4},
        "dimensions": {"type": "object", "properties": {"width_cm": {"type": "number", "minimum": 0, "maximum": 1000},
                                                        "height_cm": {"type": "number", "minimum": 0, "maximum": 1000},
                                                        "depth_cm": {"type": "number", "minimum": 0, "maximum": 1000}},
                       "required": ["width_cm", "height_cm", "depth_cm"]}},
        "required": ["sku", "name", "price", "in_stock", "tags", "dimensions"]},
}
SUBJECTS = {
    "person": ["a software engineer in Berlin", "a retired teacher from Lyon", "a student in Tokyo",
               "a chef in New York", "a nurse in Toronto", "a farmer in Kenya", "a pilot from Madrid",
               "an artist in Mexico City", "a doctor in Sydney"],
    "order": ["two pizzas and a salad", "office supplies for a small team", "a laptop and a mouse",
              "groceries for a week", "three books and a lamp", "garden tools", "a birthday party order",
              "paint and brushes"],
    "weather": ["Paris", "Oslo", "Cairo", "Lima", "Seoul", "Chicago", "Cape Town", "Reykjavik"],
    "book": ["a classic novel", "a cookbook", "a science fiction saga", "a history of Rome", "a poetry collection",
             "a programming textbook", "a children's picture book", "a mystery thriller"],
    "event": ["a Python conference", "a jazz festival", "a marathon", "a product launch", "a chess tournament",
              "a charity gala", "a science fair", "a wedding"],
    "product": ["a desk chair", "a coffee grinder", "a backpack", "a bookshelf", "a monitor stand", "a lamp",
                "a kettle", "a tent"],
}


def requests(n: int) -> list[tuple[str, str, dict]]:
    """(schema name, user message, schema) for n requests, cycling through the schemas and their subjects."""
    out = []
    names = list(SCHEMAS)
    for i in range(n):
        name = names[i % len(names)]
        subject = SUBJECTS[name][(i // len(names)) % len(SUBJECTS[name])]
        fields = ", ".join(SCHEMAS[name]["properties"])
        out.append((name, f"Give me a JSON object describing {subject}, with the fields {fields}.", SCHEMAS[name]))
    return out


def validator():
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema


def is_valid(llm, schema: dict, out, spec, jsonschema) -> bool:
    """The output is valid JSON for the schema (the engine's closed-object reading of it)."""
    from specfleet.runtime.sample.structured import close_objects

    if jsonschema is not None:
        try:
            jsonschema.validate(json.loads(out.text), close_objects(schema))
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    m = llm.engine.grammar_compiler().matcher(spec)
    tokens = [t for t in out.token_ids if t not in m.compiler.eos_token_ids]
    return m.m.validate_tokens(tokens) == len(tokens) and (m.m.consume_tokens(tokens) and m.is_accepting())


def run_system(llm, reqs, max_tokens: int, jsonschema) -> list[dict]:
    from specfleet.sampling_params import SamplingParams, StructuredOutputsParams

    warm = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=reqs[0][2]))
    llm.chat([{"role": "user", "content": "warm up"}], warm)
    rows = []
    for name, message, schema in reqs:
        spec = StructuredOutputsParams(json=schema)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
        t0 = time.perf_counter()
        out = llm.chat([{"role": "user", "content": message}], params)[0]
        dt = time.perf_counter() - t0
        m = out.metrics
        used, acc = m.get("drafts_used", {}), m.get("acceptance_by_draft", {})
        rows.append({"schema": name, "seconds": dt, "tokens": len(out.token_ids), "finish": out.finish_reason,
                     "valid": out.finish_reason == "stop" and is_valid(llm, schema, out, spec, jsonschema),
                     "steps": m.get("steps", 0), "drafted": m.get("drafted", 0), "accepted": m.get("accepted", 0),
                     "grammar_steps": used.get("grammar", 0), "grammar_acceptance": acc.get("grammar"),
                     "token_ids": list(out.token_ids), "text": out.text})
    return rows


def summarize(rows: list[dict], plain: list[dict] | None) -> dict:
    secs = sum(r["seconds"] for r in rows)
    toks = sum(r["tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    s = {"requests": len(rows), "seconds": secs, "tokens": toks, "tok_s": toks / secs if secs else 0.0,
         "finished": sum(r["finish"] == "stop" for r in rows), "valid": sum(r["valid"] for r in rows),
         "invalid": sum(r["finish"] == "stop" and not r["valid"] for r in rows),
         "tokens_per_step": toks / steps if steps else None, "drafted": sum(r["drafted"] for r in rows),
         "accepted": sum(r["accepted"] for r in rows), "grammar_steps": sum(r["grammar_steps"] for r in rows)}
    if plain is not None:
        s["equal_to_plain"] = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows, plain))
        s["speedup"] = sum(p["seconds"] for p in plain) / secs if secs else None
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="default", help="the speculative systems' draft spec (default: the model's "
                                                       "default draft, else fleet(suffix,prompt-lookup))")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    import torch

    from specfleet.bench.report import md_table, write_results
    from specfleet.llm import LLM, default_draft

    draft = args.draft
    if draft == "default":
        draft = default_draft(args.model, torch.device(args.device)) or "fleet(suffix,prompt-lookup)"
    base = LLM(args.model, draft=None, dtype=args.dtype, device=args.device)
    systems = {"plain": base,
               "spec": LLM.from_model(base.model, base.tokenizer, draft, name=args.model, dtype=args.dtype,
                                      device=args.device, grammar_draft=False),
               "spec+grammar": LLM.from_model(base.model, base.tokenizer, draft, name=args.model, dtype=args.dtype,
                                              device=args.device)}
    jsonschema = validator()
    reqs = requests(args.requests)
    results, summary = {}, {}
    for name, llm in systems.items():
        print(f"{name}: {len(reqs)} requests ...", flush=True)
        results[name] = run_system(llm, reqs, args.max_tokens, jsonschema)
        summary[name] = summarize(results[name], None if name == "plain" else results["plain"])
        print(f"  {json.dumps(summary[name])}", flush=True)
    table = [{"system": n, **s} for n, s in summary.items()]
    body = (f"Model `{args.model}`, draft `{draft}` (spec+grammar: the grammar draft in front), "
            f"{args.requests} JSON-schema chat requests, greedy, batch 1, max_tokens {args.max_tokens}; "
            f"validated with {'jsonschema' if jsonschema else 'the grammar engine'}.\n\n"
            + md_table(table, ["system", "requests", "finished", "valid", "invalid", "equal_to_plain", "tokens",
                               "seconds", "tok_s", "speedup", "tokens_per_step", "drafted", "accepted",
                               "grammar_steps"]) + "\n")
    per_schema = []
    for schema in SCHEMAS:
        row = {"schema": schema}
        for n, rows in results.items():
            mine = [r for r in rows if r["schema"] == schema]
            if mine:
                secs = sum(r["seconds"] for r in mine)
                row[f"{n} tok/s"] = sum(r["tokens"] for r in mine) / secs if secs else None
        per_schema.append(row)
    body += "\nPer schema (tokens per second):\n\n" + md_table(per_schema, list(per_schema[0])) + "\n"
    path = write_results("grammar", {"model": args.model, "draft": draft, "max_tokens": args.max_tokens,
                                     "summary": summary, "requests": results}, body, args.device, args.dtype)
    print(f"wrote {path}")
    bad = any(s["invalid"] for s in summary.values()) or any(
        s.get("equal_to_plain", len(reqs)) != len(reqs) for s in summary.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
