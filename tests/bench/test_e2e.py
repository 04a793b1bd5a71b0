"""`specfleet bench` end to end on tiny random models saved as HF folders (weights + a byte-level
tokenizer + a chat template), so that every system - specfleet with and without drafts, transformers
generate and assisted generation - runs the real code path in seconds."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from specfleet.bench.cli import main as bench_main
from specfleet.bench.hf import HFSystem, load_hf_model
from specfleet.bench.systems import Settings, parse_system
from tiny_models import tiny_hf_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 256 + len(SPECIALS)
EOS = 256 + SPECIALS.index("<|im_end|>")


def save_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target folder, draft folder): the draft is the target plus noise, so it agrees only partly."""
    root = tmp_path_factory.mktemp("bench-models")
    target = tiny_hf_model("qwen2", vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=256)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.abs().mean())
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        save_tokenizer(root / name)
    return root / "target", root / "draft"


def test_bench_end_to_end(tiny_pair, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n\nwrite a poem about the sea\nhow are you today?\n")
    out = tmp_path / "out"
    rc = bench_main(["--model", str(target), "--dataset", f"file:{prompts}", "--num-prompts", "3",
                     "--batch-sizes", "1,2", "--max-tokens", "6", "--dtype", "float32", "--ignore-eos",
                     "--no-progress", "--out", str(out), "--rowcheck-prompts", "2", "--systems", "ar", f"specfleet:{draft},k=3",
                     "specfleet:prompt-lookup", "hf", f"hf-assisted:{draft},k=3"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert data["command"].startswith("python -m specfleet.bench") or "--model" in data["command"]
    assert data["machine"]["cpu_count"] >= 1 and data["dtype"] == "float32"
    part = data["results"]["parts"][0]
    assert part["chat_template"] is True and len(part["prompts"]) == 3
    rows = {(s["system"], s["batch_size"]): s for s in part["summaries"]}
    spec, assisted = f"specfleet:{draft},k=3", f"hf-assisted:{draft},k=3"
    assert set(rows) == {(s, b) for s in ("ar", spec, "specfleet:prompt-lookup", "hf") for b in (1, 2)} | {(assisted, 1)}
    assert part["skipped"] == [{"system": assisted, "batch_size": 2, "reason": "runs batch size 1 at most"}]
    # --ignore-eos: every request of every system produces exactly max_tokens tokens
    assert all(r["output_tokens"] == 6 for r in part["requests"])
    # fp32 greedy: speculation is lossless and transformers computes the same argmaxes
    for system in (spec, "specfleet:prompt-lookup", "hf", assisted):
        assert rows[(system, 1)]["baseline_match_rate"] == 1.0, system
    # the per-row check ran beside the timings for every specfleet system (what it found on this dense fp32
    # model is reported, not asserted: BLAS products are not batch invariant; tests/bench/test_rowcheck.py holds
    # the native path to zero)
    for system in ("ar", spec, "specfleet:prompt-lookup"):
        assert rows[(system, 1)]["rows_checked"] > 0, system
    assert "rows != decode" in (out / "report.md").read_text()
    assert rows[("ar", 1)]["speedup_throughput"] == 1.0
    assert rows[("ar", 1)]["mean_accepted_length"] == 1.0
    assert rows[(spec, 1)]["drafted"] > 0 and 1.0 <= rows[(spec, 1)]["mean_accepted_length"] <= 4.0
    assert rows[(assisted, 1)]["drafted"] > 0 and rows[(assisted, 1)]["steps"] >= 2
    assert all(s["roofline_fraction"] > 0 for s in part["summaries"])
    md = (out / "report.md").read_text()
    assert "| system | batch | tok/s" in md and "roofline" in md and spec in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    pytest.importorskip("matplotlib")
    assert "custom-throughput.png" in pngs and "custom-acceptance.png" in pngs
    assert all(f"({name})" in md for name in pngs)


def test_bench_quantization_int8(tiny_pair, tmp_path):
    """--quantization int8: specfleet systems run the int8 target (and draft), and speculation is
    checked for equality against the int8 autoregressive baseline of the same run."""
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nhow are you today?\n")
    out = tmp_path / "out"
    rc = bench_main(["--model", str(target), "--dataset", f"file:{prompts}", "--num-prompts", "2",
                     "--batch-sizes", "1", "--max-tokens", "6", "--dtype", "float32", "--ignore-eos", "--no-plots",
                     "--no-progress", "--out", str(out), "--quantization", "int8",
                     "--systems", "ar", f"specfleet:{draft},k=3"])
    assert rc == 0
    part = json.loads((out / "results.json").read_text())["results"]["parts"][0]
    assert part["config"]["quantization"] == "int8"
    rows = {s["system"]: s for s in part["summaries"]}
    assert rows[f"specfleet:{draft},k=3"]["baseline_match_rate"] == 1.0
    assert rows[f"specfleet:{draft},k=3"]["drafted"] > 0
    assert "int8 (weight-only)" in (out / "report.md").read_text()


def test_hf_system_stops_at_eos_unless_ignored(tiny_pair):
    target, _ = tiny_pair
    model = load_hf_model(str(target), torch.float32, torch.device("cpu"))
    prompts = [[10, 11, 12], [20, 21]]

    def system(eos):
        return HFSystem(parse_system("hf"), model, None, device=torch.device("cpu"), spec_len=4,
                        pad_token_id=256, eos_token_ids=eos)

    free = system((EOS,)).generate(prompts, Settings(max_tokens=5, ignore_eos=True))
    assert [len(g.output_ids) for g in free] == [5, 5]
    firsts = tuple(g.output_ids[0] for g in free)  # declare each row's first token an end token
    stop = system(firsts).generate(prompts, Settings(max_tokens=5))
    assert [g.output_ids for g in stop] == [[t] for t in firsts]
    again = system(firsts).generate(prompts, Settings(max_tokens=5, ignore_eos=True))
    assert [g.output_ids for g in again] == [g.output_ids for g in free]
    assert all(g.ttft_s is not None and 0 <= g.ttft_s <= g.latency_s for g in free + stop)


def test_bench_rounds_alternate_the_order_and_pool_every_round(tiny_pair, tmp_path, monkeypatch):
    """--rounds 3: the systems run A B, B A, A B; each summary pools its 3 rounds of waves."""
    import specfleet.bench.runner as runner

    target, draft = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nhow are you today?\n")
    built = []
    real_build = runner._build
    monkeypatch.setattr(runner, "_build", lambda spec, *a, **k: built.append(spec.label) or real_build(spec, *a, **k))
    out = tmp_path / "out"
    spec = f"specfleet:{draft},k=3"
    rc = bench_main(["--model", str(target), "--dataset", f"file:{prompts}", "--num-prompts", "2",
                     "--batch-sizes", "1", "--max-tokens", "5", "--dtype", "float32", "--ignore-eos", "--no-plots",
                     "--no-progress", "--out", str(out), "--rounds", "3", "--systems", "ar", spec])
    assert rc == 0
    assert built == ["ar", spec, spec, "ar", "ar", spec]
    part = json.loads((out / "results.json").read_text())["results"]["parts"][0]
    assert [s["label"] for s in part["systems"]] == ["ar", spec]
    rows = {s["system"]: s for s in part["summaries"]}
    assert rows["ar"]["num_requests"] == 6 and rows[spec]["num_requests"] == 6
    assert rows[spec]["baseline_match_rate"] == 1.0
    assert "rounds: 3" in (out / "report.md").read_text()
    assert bench_main(["--model", str(target), "--dataset", f"file:{prompts}", "--no-progress", "--rounds", "0",
                       "--out", str(tmp_path / "o"), "--systems", "ar"]) == 2


def test_fresh_per_batch_builds_each_system_once_per_batch_size(tiny_pair, tmp_path, monkeypatch):
    """fresh_per_batch (the fleet preset's streams part): every batch size gets its own build and warm-up, so a
    suffix draft's shared trie never holds an earlier batch size's outputs of the same prompts; the fleet's state
    is kept per batch size."""
    import specfleet.bench.runner as runner
    from specfleet.bench.presets import Preset, RunConfig

    target, _ = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nhow are you today?\n")
    built = []
    real_build = runner._build
    monkeypatch.setattr(runner, "_build", lambda spec, *a, **k: built.append(spec.label) or real_build(spec, *a, **k))
    fleet = "specfleet:fleet(suffix,prompt-lookup)"
    cfg = RunConfig(name="p", model=str(target), systems=("ar", fleet), dataset=f"file:{prompts}", num_prompts=2,
                    batch_sizes=(1, 2), max_tokens=5, dtype="float32", ignore_eos=True, fresh_per_batch=True)
    part = runner.run_preset(Preset("t", "", (cfg,)), progress=False)["parts"][0]
    assert built == ["ar", "ar", fleet, fleet]
    state = next(s for s in part["systems"] if s["label"] == fleet)["strategy_state"]
    assert [s["batch_sizes"] for s in state] == [[1], [2]]
    rows = {(s["system"], s["batch_size"]): s for s in part["summaries"]}
    assert rows[(fleet, 1)]["baseline_match_rate"] == rows[(fleet, 2)]["baseline_match_rate"] == 1.0


def test_a_loop_part_sends_each_prompt_after_its_predecessor_so_the_prefix_cache_serves_it(tiny_pair, monkeypatch):
    """RunConfig.loop: the request before each prompt in its loop goes first (untimed, one token), so the timed
    request finds the context they share in the prefix cache; the same part cold finds none (the control)."""
    import specfleet.bench.runner as runner
    from specfleet.bench.datasets import Prompt
    from specfleet.bench.presets import Preset, RunConfig

    target, _ = tiny_pair
    turns = [[("user", f"{i}: tell me about the sea and the ships that sail on it " * 3),
              ("assistant", "the sea is wide and the ships are many, and each one has a name " * 2)] for i in range(2)]
    chats = [Prompt(f"c{i}", f"and what about port {i}?", (*turns[i], ("user", f"and what about port {i}?")),
                    previous=tuple(turns[i][:1])) for i in range(2)]
    monkeypatch.setattr(runner.datasets, "iter_prompts", lambda name: (iter(chats), True))
    sent = []
    real_run = runner._Timings.run
    monkeypatch.setattr(runner._Timings, "run", lambda self, system, b, prompts, ids, settings, bar, prev=None:
                        sent.append(prev) or real_run(self, system, b, prompts, ids, settings, bar, prev))
    shares = {}
    for loop in (True, False):
        cfg = RunConfig(name="p", model=str(target), systems=("ar", "specfleet:prompt-lookup"), dataset="chats",
                        num_prompts=2, max_tokens=6, dtype="float32", ignore_eos=True, loop=loop)
        part = runner.run_preset(Preset("t", "", (cfg,)), progress=False)["parts"][0]
        shares[loop] = {s["system"]: s["cached_prompt_share"] for s in part["summaries"]}
        assert part["summaries"][1]["baseline_match_rate"] == 1.0
    # byte-level tokens: the first user turn (and the template around it) is about 60 % of each prompt, and the
    # prefix cache serves it whole 16-token blocks at a time
    assert all(0.45 < v < 0.8 for v in shares[True].values()), shares
    assert all(v == 0 for v in shares[False].values()), shares
    assert sent[0] is not None and sent[-1] is None and len(sent[0]) == 2
    with pytest.raises(Exception, match="batch sizes must be"):
        runner.validate(Preset("t", "", (RunConfig(name="p", systems=("ar",), loop=True, batch_sizes=(1, 2)),)))
    with pytest.raises(Exception, match="transformers keeps no prefix cache"):
        runner.validate(Preset("t", "", (RunConfig(name="p", systems=("ar", "hf"), loop=True),)))
    plain = [Prompt("x", "hi", (("user", "hi"),))]
    monkeypatch.setattr(runner.datasets, "iter_prompts", lambda name: (iter(plain), True))
    with pytest.raises(Exception, match="has no earlier request"):
        runner.run_preset(Preset("t", "", (RunConfig(name="p", model=str(target), systems=("ar",), dataset="chats",
                                                     num_prompts=1, loop=True, dtype="float32"),)), progress=False)


def test_bench_cli_errors(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    base = ["--model", str(target), "--dataset", f"file:{prompts}", "--no-progress", "--out", str(tmp_path / "o")]
    assert bench_main(base + ["--systems", "nonsense"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert bench_main(base + ["--systems", "ar", "hf-assisted:specfleet-no-such-model"]) == 2
    assert "did not load as a model" in capsys.readouterr().err
    assert bench_main(["no-such-preset"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_bench_sampled_raw_prompts(tiny_pair, tmp_path):
    target, _ = tiny_pair
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\nclass Stack:\n")
    out = tmp_path / "o"
    assert bench_main(["--model", str(target), "--dataset", str(prompts), "--chat", "off", "--num-prompts", "2",
                       "--max-tokens", "4", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "5",
                       "--dtype", "float32", "--ignore-eos", "--no-progress", "--no-plots", "--out", str(out),
                       "--systems", "ar", "specfleet:prompt-lookup", "hf"]) == 0
    part = json.loads((out / "results.json").read_text())["results"]["parts"][0]
    assert part["chat_template"] is False and part["config"]["temperature"] == 0.8
    assert all(r["output_tokens"] == 4 for r in part["requests"]) and not list(out.glob("*.png"))
    assert "temperature 0.8, top-k 20, top-p 0.9, seed 5" in (out / "report.md").read_text()


def test_bench_reports_drafting_costs_and_the_fleets_own_measurements(tiny_pair, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there hello there hello there\nwrite a poem about the sea\n")
    out = tmp_path / "out"
    fleet = f"specfleet:fleet({draft},prompt-lookup)"
    rc = bench_main(["--model", str(target), "--dataset", f"file:{prompts}", "--num-prompts", "2",
                     "--batch-sizes", "1", "--max-tokens", "12", "--dtype", "float32", "--ignore-eos",
                     "--no-progress", "--no-plots", "--out", str(out), "--systems", "ar", fleet,
                     f"specfleet:{draft},k=3"])
    assert rc == 0
    part = json.loads((out / "results.json").read_text())["results"]["parts"][0]
    systems = {s["label"]: s for s in part["systems"]}
    assert "strategy_state" not in systems["ar"]
    (state,) = systems[fleet]["strategy_state"]  # one round
    report = next(v["fleet"] for v in state.values() if "fleet" in v)
    assert report["request_steps"] > 0
    assert abs(sum(report["share"].values()) - 1.0) < 0.01  # members, merged and plain cover every step
    md = (out / "report.md").read_text()
    assert "Drafting cost and acceptance by position" in md and "acc@1" in md
    assert f"| specfleet:{draft},k=3 | 1 |" in md  # the single draft's d and acceptance row
    assert "Fleet fleet(" in md and "| prompt-lookup |" in md and "| plain |" in md
    # the tiny vocabulary lies below both cuts: every token of the baseline is covered
    assert part["head_vocab_coverage"] == {"32768": 1.0, "65536": 1.0} and "N=65536: 1.0000" in md
