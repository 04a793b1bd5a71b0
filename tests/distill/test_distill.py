"""Draft distillation on a tiny random target: the pieces agree with the runtime, training helps,
training resumes, and the saved draft is an ordinary checkpoint that keeps speculation lossless."""
import argparse
import json

import pytest
import torch

from specfleet.distill.cli import add_distill_parser
from specfleet.runtime.loading.weights import load_weights
from specfleet.distill.data import (Example, append_continuations, generate_continuations, read_continuations,
                                    select_vocab, to_sequences)
from specfleet.distill.evaluate import agreement, greedy_labels
from specfleet.distill.init import build_student, make_spec, spread_layers
from specfleet.distill.losses import distill_loss
from specfleet.distill.pipeline import Distillation
from specfleet.distill.student import causal_forward
from specfleet.distill.train import read_checkpoint
from specfleet.errors import SpecfleetError
from specfleet.llm import LLM
from specfleet.runtime.loading.build import build_model
from specfleet.runtime.loading.checkpoint import load_checkpoint
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.model.config import ModelConfig
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from tiny_engines import make_engine
from tiny_models import ours_from_hf, random_prompts, run_to_completion, tiny_hf_model

VOCAB = 259  # the 256 byte tokens of a byte-level BPE and three specials
EOS = 258


@pytest.fixture(scope="module")
def hf_target():
    return tiny_hf_model("qwen2", vocab_size=VOCAB, eos_token_id=EOS)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, hf_target):
    """The tiny target as a checkpoint folder with a byte-level tokenizer (no merges)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    folder = tmp_path_factory.mktemp("target")
    hf_target.save_pretrained(folder)
    tokens = list(bytes_to_unicode().values()) + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], eos_token="<|im_end|>",
                         unk_token=None, pad_token="<|endoftext|>",
                         chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    words = ["def", "fib", "return", "hello", "x", "print", "if", "for", "in", "the"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 5)) + f" {i}" for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


def distill_args(target_dir, out, prompts_file, *extra):
    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args([
        "distill", "--target", str(target_dir), "--out", str(out), "--prompts", str(prompts_file),
        "--num-prompts", "40", "--num-heldout", "8", "--max-new-tokens", "24", "--init-from", "none", "--layers", "1",
        "--hidden", "32", "--heads", "2", "--vocab-top", "48", "--lr", "3e-3", "--batch-tokens", "512",
        "--save-dtype", "float32", "--eval-dtype", "float32", "--seed", "0", *extra])


def test_causal_forward_matches_the_reference_model(hf_target):
    ours = ours_from_hf(hf_target)
    ids = torch.tensor([random_prompts([12], VOCAB)[0], random_prompts([7], VOCAB, seed=2)[0] + [0] * 5])
    with torch.no_grad():
        expected = hf_target(ids).logits
        got = ours.compute_logits(causal_forward(ours, ids))
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, :7], expected[1, :7], atol=1e-4, rtol=1e-4)  # padding never leaks back


def test_agreement_with_a_reference_models_argmax(hf_target):
    model = ours_from_hf(hf_target)
    seqs = to_sequences([Example(str(i), p, p[:3]) for i, p in enumerate(random_prompts([6, 9, 4], VOCAB))], 64)
    assert agreement(model, seqs, reference=greedy_labels(model, seqs)) == 1.0
    assert agreement(model, seqs) < 0.5  # against the stored tokens, which this random model does not repeat


def test_spread_layers_keeps_first_and_last():
    assert spread_layers(24, 3) == (0, 12, 23) and spread_layers(24, 2) == (0, 23) and spread_layers(24, 1) == (0,)


def test_select_vocab_ranks_continuations_then_prompts_then_low_ids():
    examples = [Example("a", [7, 7, 9], [5, 5, 5, 3]), Example("b", [9, 8], [3, 6])]
    assert select_vocab(examples, 3, 100, always=(99,)).tolist() == [3, 5, 99]
    assert select_vocab(examples, 7, 100).tolist() == [0, 3, 5, 6, 7, 8, 9]  # then 9, 7, 8, then id 0


def test_generation_resumes_after_a_torn_line(tmp_path):
    class FakeLLM:
        asked: list = []

        def generate(self, prompts, params):
            self.asked += prompts
            return [type("Out", (), {"token_ids": [p[0] + 1], "text": ""})() for p in prompts]

    path = tmp_path / "c.jsonl"
    append_continuations(path, [Example("p0", [1], [2])])
    with open(path, "a") as f:
        f.write('{"id": "p1", "prompt_')  # an interrupted write
    llm = FakeLLM()
    out = generate_continuations(llm, [("p0", [1]), ("p1", [10]), ("p2", [20])], 4, path, chunk_size=1)
    assert llm.asked == [[10], [20]]
    assert [ex.continuation_ids for ex in out] == [[2], [11], [21]]
    assert [ex.id for ex in read_continuations(path)] == ["p0", "p1", "p2"]


def test_reduced_head_export_has_the_training_distribution(hf_target):
    """The exported full-vocabulary draft's softmax equals the training softmax with out-of-set pooled."""
    target_cfg = ModelConfig.from_hf_dict(hf_target.config.to_dict())
    weights = dict(hf_target.state_dict())
    spec = make_spec(target_cfg, target_cfg, "target", 1, vocab_size=40)
    student = build_student(spec, torch.arange(0, 200, 5), weights, target_cfg)
    exported = DecoderLM(spec.model_config())
    load_weights(exported, student.export_weights(torch.float32))
    ids = torch.tensor(random_prompts([10], VOCAB))
    with torch.no_grad():
        hidden = causal_forward(student.body, ids)[0]
        log_q = torch.log_softmax(student.class_logits(hidden), -1)  # [T, 41]
        full = torch.log_softmax(exported.compute_logits(causal_forward(exported, ids)[0]), -1)  # [T, 97]
    torch.testing.assert_close(full[:, student.vocab_ids], log_q[:, :40], atol=1e-5, rtol=1e-5)
    out_of_set = torch.ones(VOCAB, dtype=torch.bool)
    out_of_set[student.vocab_ids] = False
    torch.testing.assert_close(full[:, out_of_set].logsumexp(-1), log_q[:, 40], atol=1e-5, rtol=1e-5)
    # the loss is the exported model's NLL, out-of-set labels included
    labels = torch.zeros_like(ids)
    labels[0, :-1] = ids[0, 1:]
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, -1] = False
    parts = distill_loss(student, ids, labels, mask)
    nll = -full[:-1].gather(1, ids[0, 1:, None]).mean()
    assert abs(parts.ce - float(nll)) < 1e-5


def test_distill_trains_resumes_and_saves_a_lossless_draft(target_dir, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "draft"
    Distillation(distill_args(target_dir, out, prompts_file, "--max-steps", "40", "--no-eval")).run()
    saved = read_checkpoint(out)
    history = saved["state"]["history"]
    first, last = history[0], history[-1]
    assert last["heldout_loss"] < first["heldout_loss"] - 0.5
    assert last["heldout_agreement"] > first["heldout_agreement"] + 0.1
    assert saved["state"]["step"] == 40
    records = (out / "continuations.jsonl").read_text().splitlines()
    assert len(records) == 40 and all(json.loads(r)["continuation_ids"] for r in records)

    with pytest.raises(SpecfleetError, match="--resume"):
        Distillation(distill_args(target_dir, out, prompts_file, "--max-steps", "60", "--no-eval"))
    with pytest.raises(SpecfleetError, match="other settings"):
        Distillation(distill_args(target_dir, out, prompts_file, "--max-steps", "60", "--no-eval", "--resume",
                                  "--layers", "2")).run()
    from specfleet.bench import report

    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "results")
    payload = Distillation(distill_args(target_dir, out, prompts_file, "--max-steps", "60", "--resume",
                                        "--eval-prompts", "2", "--eval-max-tokens", "12",
                                        "--compare", f"{target_dir}@1")).run()
    resumed = read_checkpoint(out)["state"]
    assert resumed["step"] == 60 and resumed["history"][:len(history)] == history
    assert len((out / "continuations.jsonl").read_text().splitlines()) == 40  # nothing regenerated
    names = [r["draft"] for r in payload["comparison"]["drafts"]]
    assert names[0] == "distilled" and f"{target_dir}@1" in names
    assert all(r["same_output_as_plain"] for r in payload["comparison"]["drafts"] if "same_output_as_plain" in r)
    assert list((tmp_path / "results").glob("distill-*.md"))

    # the folder is an ordinary checkpoint; as a proposer it keeps greedy output exact
    ckpt = load_checkpoint(out)
    assert ckpt.config.num_layers == 1 and ckpt.config.vocab_size == VOCAB and not ckpt.config.tie_word_embeddings
    draft = build_model(ckpt.config, ckpt.weights, torch.float32, torch.device("cpu"))
    target = ours_from_hf(tiny_hf_model("qwen2", vocab_size=VOCAB, eos_token_id=EOS))
    prompts = random_prompts([5, 17, 9], VOCAB)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run_to_completion(make_engine(target), prompts, greedy)
    engine = make_engine(target, DraftModelProposer(draft, "distilled", DraftModelConfig(4, kv_cache_bytes=64 << 10)))
    spec = run_to_completion(engine, prompts, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert 0 < engine.stats.num_accepted < engine.stats.num_drafted
    llm = LLM(str(target_dir), draft=str(out), dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [o.token_ids for o in plain]


def test_teacher_labels_on_prompts_and_kl(target_dir, prompts_file, tmp_path):
    """Prompt positions labelled by the target's argmax, text-only prompts, and the cached top-k KL."""
    out = tmp_path / "draft"
    Distillation(distill_args(target_dir, out, prompts_file, "--num-prompts", "20", "--num-text-prompts", "20",
                              "--label-prompts", "--kl-weight", "0.5", "--kl-top-k", "8", "--max-steps", "30",
                              "--no-eval")).run()
    history = read_checkpoint(out)["state"]["history"]
    assert history[-1]["heldout_loss"] < history[0]["heldout_loss"] - 0.5
    assert history[-1]["heldout_agreement"] > history[0]["heldout_agreement"] + 0.1
    assert len((out / "continuations.jsonl").read_text().splitlines()) == 20  # text-only prompts are not continued
    assert (out / "teacher_topk.pt").is_file()
