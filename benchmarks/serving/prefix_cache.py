"""Multi-turn chat with and without the prefix cache: time to first token per turn, through the official
`openai` client against `specfleet serve` in its own process (the default speculation, greedy).

The conversation starts with a long user message (a Python module from the interpreter's standard library
and a question about it, about `--context` tokens), then each turn sends the whole conversation again,
with the model's answer and a new question, as a chat client does. The same conversation runs against a
server with the prefix cache on (the default) and one started with `--no-prefix-caching`; the answers
must be identical, and the report gives each turn's time to first token, the prompt tokens the cache
served (usage.prompt_tokens_details.cached_tokens), and the ratio of a later turn's first-token time to
the first turn's.

    python benchmarks/serving/prefix_cache.py --model qwen-1.5b --context 2000 --turns 3 --max-tokens 64

Writes benchmarks/results/prefix-cache-cpu-<time>/results.json and report.md; exits 1 if the answers differ.
"""
from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from servers import free_port, start  # one way to start a server and wait for it (benchmarks/peers/servers.py)

QUESTIONS = ["What does this module do? Answer in two sentences.",
             "Write a short usage example of its main function.",
             "Which edge cases should a test of it cover? List three.",
             "Summarise our conversation in one sentence."]


def start_specfleet(model: str, draft: str, caching: bool, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [str(Path(sys.executable).with_name("specfleet")), "serve", "--model", model, "--port", str(free_port()),
           "--draft", draft] + ([] if caching else ["--no-prefix-caching"])
    return start(cmd, log)


def long_message(url: str, context: int) -> str:
    """About `context` tokens of a standard-library module's source (cut with the server's own tokenizer),
    with a question after it."""
    import textwrap as module_to_read

    source = inspect.getsource(module_to_read)
    ids = httpx.post(url + "/tokenize", json={"prompt": source, "add_special_tokens": False}, timeout=60).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": ids[:context]}, timeout=60).json()["prompt"]
    return "Here is a Python module:\n\n```python\n" + text + "\n```\n\n" + QUESTIONS[0]


def run_conversation(url: str, model: str, first: str, turns: int, max_tokens: int) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    messages = [{"role": "user", "content": first}]
    out = []
    for turn in range(turns):
        t0 = time.perf_counter()
        ttft, parts, usage = None, [], None
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        total = time.perf_counter() - t0
        answer = "".join(parts)
        details = getattr(usage, "prompt_tokens_details", None)
        out.append({"turn": turn + 1, "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                    "cached_tokens": getattr(details, "cached_tokens", None) or 0, "ttft_s": round(ttft or total, 3),
                    "total_s": round(total, 3), "answer": answer})
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--context", type=int, default=2000, help="tokens of module source in the first message")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from specfleet.bench.report import md_table, result_path, run_metadata, write_folder

    first = None
    runs = {}
    logdir = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    for caching in (True, False):
        name = "cache on" if caching else "cache off"
        proc, url = start_specfleet(args.model, args.draft, caching, logdir / f"{name.replace(' ', '-')}.log")
        try:
            first = first or long_message(url, args.context)
            runs[name] = run_conversation(url, args.model, first, args.turns, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        for t in runs[name]:
            print(f"{name:9s} turn {t['turn']}: prompt {t['prompt_tokens']:5d} cached {t['cached_tokens']:5d} "
                  f"ttft {t['ttft_s']:7.2f} s  total {t['total_s']:7.2f} s", flush=True)
    same = [a["answer"] == b["answer"] for a, b in zip(runs["cache on"], runs["cache off"])]
    rows = []
    for on, off, eq in zip(runs["cache on"], runs["cache off"], same):
        rows.append({"turn": on["turn"], "prompt tokens": on["prompt_tokens"], "cached (on)": on["cached_tokens"],
                     "TTFT on s": on["ttft_s"], "TTFT off s": off["ttft_s"],
                     "on / turn 1 on": round(on["ttft_s"] / runs["cache on"][0]["ttft_s"], 3),
                     "on / off": round(on["ttft_s"] / off["ttft_s"], 3), "answers equal": eq})
    print(md_table(rows, list(rows[0])))
    meta = run_metadata("prefix-cache", dtype="gguf")
    payload = {"model": args.model, "draft": args.draft, "context_tokens": args.context, "turns": args.turns,
               "max_tokens": args.max_tokens, "runs": runs, "answers_equal": all(same), "summary": rows,
               "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}}
    body = textwrap.dedent(f"""\
        Model {args.model}, draft {args.draft}, greedy, {args.max_tokens} tokens per answer, through the official
        `openai` client (streamed) against `specfleet serve` in its own process; the first message holds about
        {args.context} tokens of `textwrap.py`; every turn resends the whole conversation.

        """) + md_table(rows, list(rows[0])) + f"\n\nAnswers identical with the cache on and off: {all(same)}\n"
    out_dir = result_path(meta)
    json_path, _ = write_folder(out_dir, meta, payload, body)
    print(f"wrote {json_path}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
