"""Structured-output coverage on a public JSON Schema suite: which schemas a server compiles, and whether
its greedy outputs under them are valid (issue 48), for `specfleet serve` and a native `llama-server`.

The schemas are the official JSON-Schema-Test-Suite's (written by others, for validators): every test
group's schema of one draft (default draft2020-12, `optional/` included), deduplicated. The suite is not
part of this repository; give its path (a checkout, or a bare git directory such as `fetch` makes):

    git clone https://github.com/json-schema-org/JSON-Schema-Test-Suite /tmp/JSON-Schema-Test-Suite
    flock /tmp/specfleet-bench.lock python benchmarks/peers/schema_coverage.py --suite /tmp/JSON-Schema-Test-Suite \
        --model qwen-0.5b --llama-server /path/to/llama-server --sample 100 --max-tokens 60

0. Soundness, in process: each test group's schema as specfleet plans it by default, and every instance
   of the suite walked through its grammar (accepted invalid instances are counted, with examples).
1. Coverage: every schema is sent once to each server as a 1-token request (prompt "{"): a 400 (or, for
   llama-server, any error) means the server refused it. specfleet is asked twice: as a client leaving
   `strict` unsaid (the default: a keyword it cannot enforce is refused) and with `strict: false`
   (generated under the enforceable part; the response lists what was not enforced).
2. Validity: a fixed sample of the schemas (every k-th in the suite's file order, k chosen for --sample)
   gets one greedy request each, the same prompt text on both servers (the model's chat template applied
   here: "Write one JSON value that is valid against this JSON Schema ..."), at most --max-tokens tokens.
   specfleet runs with `strict: false`, so its outputs for schemas it fully enforces are the default's and
   the rest show what the relaxed mode gives. Each output is checked with `jsonschema` (the draft's
   validator, formats asserted where jsonschema can, remote `$ref`s resolved from the suite's remotes/).

Writes benchmarks/results/schema-coverage-cpu-<time>/results.json and report.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specfleet.bench.startup import wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPT = ("Write one JSON value that is valid against this JSON Schema, and nothing else.\n"
          "JSON Schema: {schema}")


class Suite:
    """The test suite's files, from a checkout or a bare git directory."""

    def __init__(self, path: Path):
        self.path = path
        self.git = None if (path / "tests").is_dir() else path
        if self.git is not None and subprocess.run(["git", "--git-dir", str(path), "rev-parse", "HEAD"],
                                                   capture_output=True).returncode != 0:
            raise SystemExit(f"{path} is neither a JSON-Schema-Test-Suite checkout nor its git directory")

    def commit(self) -> str:
        args = ["git", "--git-dir", str(self.git)] if self.git else ["git", "-C", str(self.path)]
        out = subprocess.run(args + ["rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"

    def files(self, under: str) -> list[str]:
        if self.git is None:
            root = self.path
            return sorted(str(p.relative_to(root)) for p in (root / under).rglob("*.json"))
        out = subprocess.run(["git", "--git-dir", str(self.git), "ls-tree", "-r", "--name-only", "HEAD", under],
                             capture_output=True, text=True, check=True)
        return sorted(f for f in out.stdout.split() if f.endswith(".json"))

    def read(self, name: str):
        if self.git is None:
            return json.loads((self.path / name).read_text())
        out = subprocess.run(["git", "--git-dir", str(self.git), "show", f"HEAD:{name}"], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout)


def load_schemas(suite: Suite, draft: str) -> list[dict]:
    seen: dict[str, dict] = {}
    for name in suite.files(f"tests/{draft}"):
        for i, group in enumerate(suite.read(name)):
            key = json.dumps(group["schema"], sort_keys=True)
            if key not in seen:
                seen[key] = {"id": f"{name.split('/', 2)[-1]}#{i}", "description": group["description"],
                             "schema": group["schema"], "remote": "localhost:1234" in key, "satisfiable": False}
            # a schema the suite gives no valid instance for may admit none: refusing it is right
            seen[key]["satisfiable"] |= any(t["valid"] for t in group["tests"])
    return list(seen.values())


def registry(suite: Suite):
    """The suite's remotes/ (what its http://localhost:1234/ refs name), for jsonschema."""
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    resources = []
    for name in suite.files("remotes"):
        try:
            doc = suite.read(name)
        except ValueError:
            continue
        uri = "http://localhost:1234/" + name.split("/", 1)[1]
        resources.append((uri, Resource.from_contents(doc, default_specification=DRAFT202012)))
    return Registry().with_resources(resources)


def validator_for(draft: str):
    import jsonschema

    return {"draft2020-12": jsonschema.Draft202012Validator, "draft2019-09": jsonschema.Draft201909Validator,
            "draft7": jsonschema.Draft7Validator, "draft6": jsonschema.Draft6Validator,
            "draft4": jsonschema.Draft4Validator}[draft]


def check(output: str, schema, cls, reg) -> str:
    """valid | invalid | not_json | unknown (the validator itself failed)."""
    try:
        value = json.loads(output)
    except ValueError:
        return "not_json"
    try:
        ok = cls(schema, registry=reg, format_checker=cls.FORMAT_CHECKER).is_valid(value)
    except Exception:  # noqa: BLE001 - an unresolvable ref and the like: not the output's fault
        return "unknown"
    return "valid" if ok else "invalid"


def soundness(suite: Suite, draft: str) -> dict:
    """In process, no model: every test group's schema planned as the server plans it by default, and
    each of the suite's instances (as json.dumps writes it) walked byte by byte through its grammar.
    `accepted_invalid` counts instances the suite marks invalid that the grammar of a fully enforced
    schema (nothing noted as not enforced) accepts: with `format_annotation`, under a format that is an
    annotation here; the rest are the grammar engine's own approximations (formats, regex dialect)."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    from specfleet.errors import InvalidRequestError
    from specfleet.runtime.sample.structured import COMPACT_JSON
    from specfleet.runtime.sample.json_schema import plan

    class Bytes:
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        eos_token_id, bos_token_id = 256, None

        def __call__(self, text):
            return list(text.encode())

    tok = llguidance.LLTokenizer(TokenizerWrapper(Bytes()), n_vocab=257)
    out = {"groups": 0, "compiled": 0, "valid_accepted": 0, "valid_rejected": 0, "invalid_rejected": 0,
           "accepted_invalid": 0, "accepted_invalid_format_annotation": 0, "examples": []}
    for name in suite.files(f"tests/{draft}"):
        for group in suite.read(name):
            out["groups"] += 1
            try:
                p = plan(group["schema"], dict(COMPACT_JSON), relaxed=False)
            except InvalidRequestError:
                continue
            out["compiled"] += 1
            annotated_format = any(n.keyword.startswith("format:") for n in p.notes.annotations)
            for t in group["tests"]:
                m = llguidance.LLMatcher(tok, p.grammar, log_level=0)
                text = json.dumps(t["data"], ensure_ascii=False)
                ok = bool(m.consume_tokens(list(text.encode()))) and m.is_accepting()
                if t["valid"]:
                    out["valid_accepted" if ok else "valid_rejected"] += 1
                elif not ok:
                    out["invalid_rejected"] += 1
                elif annotated_format:
                    out["accepted_invalid_format_annotation"] += 1
                else:
                    out["accepted_invalid"] += 1
                    out["examples"].append(f"{name.split('/', 2)[-1]}: {t['description']}")
    return out


# -- the two servers ------------------------------------------------------------------------------
def start(cmd: list[str], log: Path, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}  # each server's own default threading
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    wait_healthy(proc, f"http://127.0.0.1:{port}", 900, lambda: log.read_text()[-3000:], poll_s=1)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def as_object(schema):
    """Both servers take a schema object only: a boolean schema is sent as its equivalent {"allOf": [b]}."""
    return schema if isinstance(schema, dict) else {"allOf": [schema]}


def specfleet_request(url: str, prompt: str, schema, max_tokens: int, strict: bool | None) -> dict:
    js = {"name": "schema", "schema": as_object(schema)}
    if strict is not None:
        js["strict"] = strict
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": js}}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    out = {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3)}
    data = r.json()
    if r.status_code != 200:
        out["error"] = data.get("error", {}).get("message", "")[:300]
        return out
    c = data["choices"][0]
    out.update(text=c["text"], finish=c["finish_reason"], tokens=data["usage"]["completion_tokens"],
               notes=data.get("structured_output", {}))
    return out


def llama_request(url: str, prompt: str, schema, max_tokens: int) -> dict:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "json_schema": as_object(schema),
            "cache_prompt": True}
    t0 = time.perf_counter()
    r = httpx.post(url + "/completion", json=body, timeout=600)
    out = {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3)}
    try:
        data = r.json()
    except ValueError:
        data = {"error": r.text}
    if r.status_code != 200:
        err = data.get("error")
        out["error"] = (err.get("message", "") if isinstance(err, dict) else str(err))[:300]
        return out
    finish = "stop" if data.get("stop_type") in ("eos", "word") else "length"
    out.update(text=data.get("content", ""), finish=finish, tokens=data.get("tokens_predicted"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", required=True, type=Path, help="JSON-Schema-Test-Suite checkout or git directory")
    ap.add_argument("--draft", default="draft2020-12")
    ap.add_argument("--model", default="qwen-0.5b")
    ap.add_argument("--llama-server", default=None, help="a native llama-server binary (left out: specfleet only)")
    ap.add_argument("--sample", type=int, default=100, help="schemas in the validity run (0: none)")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--port", type=int, default=18810, help="specfleet's port; llama-server gets the next one")
    ap.add_argument("--draft-spec", default=None, help="specfleet's --draft (default: the model's default)")
    args = ap.parse_args()

    from specfleet.bench.llamacpp import gguf_path
    from specfleet.bench.report import md_table, result_path, run_metadata, write_folder

    suite = Suite(args.suite)
    schemas = load_schemas(suite, args.draft)
    reg = registry(suite)
    cls = validator_for(args.draft)
    k = max(1, len(schemas) // args.sample) if args.sample else 0
    sample = schemas[::k][:args.sample] if k else []
    meta = run_metadata("schema-coverage", "cpu", "gguf as stored")
    out_dir = result_path(meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer  # noqa: F401 - the chat template comes from specfleet's loader
    from specfleet.runtime.loading.checkpoint import tokenizer_folder

    gguf = gguf_path(args.model)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder(gguf)))

    def prompt_of(schema) -> str:
        return tok.apply_chat_template([{"role": "user", "content": PROMPT.format(schema=json.dumps(schema))}],
                                       tokenize=False, add_generation_prompt=True)

    sound = soundness(suite, args.draft)
    print(f"soundness: {json.dumps({k: v for k, v in sound.items() if k != 'examples'})}", flush=True)
    systems: dict[str, dict] = {}
    sf_cmd = [str(Path(sys.executable).with_name("specfleet")), "serve", "--model", args.model, "--port",
              str(args.port), "--kv-cache-mb", "512", *(["--draft", args.draft_spec] if args.draft_spec else [])]
    runs = [("specfleet", sf_cmd, args.port)]
    if args.llama_server:
        runs.append(("llama-server", [args.llama_server, "-m", str(gguf), "--port", str(args.port + 1),
                                      "-np", "1", "-c", "4096"], args.port + 1))
    for name, cmd, port in runs:
        url = f"http://127.0.0.1:{port}"
        proc = start(cmd, out_dir / f"{name}.log", port)
        try:
            res: dict = {"command": " ".join(cmd), "coverage": [], "outputs": []}
            t0 = time.perf_counter()
            for s in schemas:
                row = {"id": s["id"]}
                if name == "specfleet":
                    for mode, strict in (("default", None), ("relaxed", False)):
                        r = specfleet_request(url, "{", s["schema"], 1, strict)
                        row[mode] = r["status"] == 200
                        if r["status"] != 200:
                            row[f"{mode}_error"] = r.get("error")
                else:
                    r = llama_request(url, "{", s["schema"], 1)
                    row["default"] = r["status"] == 200
                    if r["status"] != 200:
                        row["default_error"] = r.get("error")
                res["coverage"].append(row)
            res["coverage_s"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            for s in sample:
                p = prompt_of(s["schema"])
                r = (specfleet_request(url, p, s["schema"], args.max_tokens, False) if name == "specfleet"
                     else llama_request(url, p, s["schema"], args.max_tokens))
                r["id"] = s["id"]
                if r["status"] == 200:
                    r["check"] = check(r["text"].strip(), s["schema"], cls, reg)
                res["outputs"].append(r)
                print(f"{name} {s['id']}: {r.get('check', r.get('error', '')[:80])}", flush=True)
            res["validity_s"] = round(time.perf_counter() - t0, 1)
            systems[name] = res
        finally:
            stop(proc)

    # -- summary ----------------------------------------------------------------------------------
    n_all, n_local = len(schemas), sum(not s["remote"] for s in schemas)
    remote = {s["id"] for s in schemas if s["remote"]}
    usable = {s["id"] for s in schemas if not s["remote"] and s["satisfiable"]}
    rows = []
    for name, res in systems.items():
        for mode in (("default", "relaxed") if name == "specfleet" else ("default",)):
            cov = [r for r in res["coverage"] if r.get(mode)]
            label = name if mode == "default" else f"{name} (strict=false)"
            outs = res["outputs"]
            if name == "specfleet" and mode == "default":  # the default refuses what relaxed noted as not enforced
                outs = [o for o in outs if o["status"] == 200 and not o.get("notes", {}).get("not_enforced")]
            else:
                outs = [o for o in outs if o["status"] == 200]
            valid = sum(o.get("check") == "valid" for o in outs)
            rows.append({"system": label, "compiled": len(cov), "of": n_all,
                         "share": round(len(cov) / n_all, 3),
                         "compiled_local": sum(r["id"] not in remote for r in cov), "of_local": n_local,
                         "compiled_usable": sum(r["id"] in usable for r in cov), "of_usable": len(usable),
                         "share_usable": round(sum(r["id"] in usable for r in cov) / len(usable), 3),
                         "sample": len(sample), "generated": len(outs),
                         "finished": sum(o.get("finish") == "stop" for o in outs), "valid": valid,
                         "valid_of_generated": round(valid / len(outs), 3) if outs else None,
                         "valid_of_sample": round(valid / len(sample), 3) if sample else None,
                         "invalid": sum(o.get("check") == "invalid" for o in outs),
                         "not_json": sum(o.get("check") == "not_json" for o in outs)})
    payload = {"suite": str(args.suite), "suite_commit": suite.commit(), "draft": args.draft, "model": args.model,
               "gguf": str(gguf), "max_tokens": args.max_tokens, "sample_rule": f"every {k}-th schema in file order",
               "schemas": n_all, "remote_ref_schemas": n_all - n_local, "summary": rows,
               "soundness": sound, "systems": systems, "sample_ids": [s["id"] for s in sample]}
    body = (f"JSON-Schema-Test-Suite {payload['suite_commit'][:12]}, tests/{args.draft}: {n_all} distinct schemas "
            f"({n_all - n_local} reference the suite's remotes, which no server fetches; 'usable': the "
            f"{len(usable)} others the suite gives at least one valid instance for). Model {args.model} "
            f"({gguf.name}), greedy, at most {args.max_tokens} tokens; validity sample: {len(sample)} schemas, "
            f"{payload['sample_rule']}.\n\n"
            + md_table(rows, ["system", "compiled", "of", "share", "compiled_usable", "of_usable", "share_usable",
                              "generated",
                              "finished", "valid", "valid_of_generated", "valid_of_sample", "invalid", "not_json"])
            + f"\n\nGrammar soundness in process (specfleet's default plan, the suite's instances as json.dumps "
              f"writes them): {sound['compiled']} of {sound['groups']} test groups compiled; invalid instances "
              f"rejected {sound['invalid_rejected']}, accepted {sound['accepted_invalid']} (the grammar engine's "
              f"format / regex approximations) + {sound['accepted_invalid_format_annotation']} under formats that "
              f"are annotations; valid instances accepted {sound['valid_accepted']}, rejected "
              f"{sound['valid_rejected']} (property order, narrowing).\n")
    json_path, md_path = write_folder(out_dir, meta, payload, body)
    print(body)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
