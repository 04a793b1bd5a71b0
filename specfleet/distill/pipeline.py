"""One distillation run, start to finish: data -> student -> training -> checkpoint folder -> report.

Each stage can be interrupted and rerun: continuations are appended as they are generated, the
teacher top-k cache is saved as it fills, training checkpoints every few minutes, and the draft is
written at the end. Only the target's forward passes cost real time on a CPU; they happen before
training (generation, top-k) and after it (evaluation), and the target is released in between.
"""
from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import torch

from specfleet.distill.data import (Example, generate_continuations, read_continuations, select_vocab,
                                    split_heldout, to_sequences)
from specfleet.distill.export import save_draft
from specfleet.distill.init import build_student, make_spec
from specfleet.distill.sources import load_config, load_model, load_source, load_tokenizer
from specfleet.distill.teacher import TopKCache, teacher_topk
from specfleet.distill.train import TrainConfig, Trainer, read_checkpoint
from specfleet.errors import ModelLoadError, SpecfleetError
from specfleet.runtime.loading.build import parse_device, parse_dtype
from specfleet.runtime.formats.quant import quantize_model

logger = logging.getLogger(__name__)
DEFAULT_DATASETS = ("humaneval", "chitchat")


def canonical_model(name: str) -> str:
    """A registered name for any alias, else the absolute path: what a resumed run must match."""
    from specfleet.registry import lookup

    try:
        return lookup(name).name
    except ModelLoadError:
        return str(Path(name).expanduser().resolve())


class Distillation:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).expanduser()
        self.dtype = parse_dtype(args.dtype)
        self.device = parse_device(args.device)
        self.saved = read_checkpoint(self.out)
        if self.saved is not None and not args.resume:
            raise SpecfleetError(f"{self.out} already holds a training checkpoint; pass --resume to continue it "
                                 "or choose another --out")
        if args.num_text_prompts and not args.label_prompts:
            raise SpecfleetError("--num-text-prompts gives prompts without continuations: add --label-prompts "
                                 "so the teacher labels them")
        self.timings: dict[str, float] = {}
        self._teacher_model = None

    def teacher_model(self):
        """The teacher on the device, loaded on first use: a rerun whose data is complete never loads it."""
        if self._teacher_model is None:
            a = self.args
            self._teacher_model, _ = load_model(a.teacher or a.target, self.dtype, self.device)
            quantize_model(self._teacher_model, a.teacher_quantization)
            if self._teacher_model.config.vocab_size != self.target_cfg.vocab_size:
                raise SpecfleetError(f"--teacher has {self._teacher_model.config.vocab_size} tokens, the target "
                                     f"{self.target_cfg.vocab_size}: the teacher must share the target's tokenizer")
        return self._teacher_model

    def run(self) -> dict | None:
        a = self.args
        torch.manual_seed(a.seed)
        self.target_cfg, target_dir = load_config(a.target)
        examples = self.continuations(target_dir)
        train_ex, held_ex = split_heldout(examples, a.num_heldout)
        train_seqs = to_sequences(train_ex, a.max_seq_len, all_positions=a.label_prompts)
        held_seqs = to_sequences(held_ex, a.max_seq_len)
        student = self.build_student(train_ex)
        teacher = self.teacher(train_seqs)
        if not ((a.kl_weight > 0 or a.label_prompts) and a.kl_source == "online"):
            self._teacher_model = None  # 7 GB for the 1.5B in fp32: not needed while training
            gc.collect()
        cfg = TrainConfig(lr=a.lr, weight_decay=a.weight_decay, batch_tokens=a.batch_tokens, max_steps=a.max_steps,
                          time_budget_s=a.time_budget_min * 60, checkpoint_every_s=a.checkpoint_every_min * 60,
                          kl_weight=a.kl_weight, teacher_labels=a.label_prompts, seed=a.seed)
        trainer = Trainer(student, train_seqs, held_seqs, cfg, self.out, teacher)
        if self.saved is not None:
            trainer.load(self.saved)
        state = trainer.run()
        meta = {"target": canonical_model(a.target), "teacher": canonical_model(a.teacher or a.target),
                "spec": student.spec.as_dict(), "train_config": vars(cfg), "steps": state.step,
                "epochs": state.epoch, "training_s": state.elapsed_s, "history": state.history,
                "num_train_examples": len(train_ex), "num_heldout_examples": len(held_ex), "timings": self.timings}
        save_draft(self.out, student, target_dir, parse_dtype(a.save_dtype), meta)
        logger.info("draft saved to %s (use it as --draft %s)", self.out, self.out)
        if not a.eval:
            return None
        from specfleet.distill.report import evaluate_and_report

        del student, trainer, teacher
        self._teacher_model = None
        gc.collect()
        return evaluate_and_report(a, self.out, meta, train_ex, held_ex, held_seqs, parse_dtype(a.eval_dtype),
                                   self.device)

    # -- data ------------------------------------------------------------------------------------
    def _teacher_file(self, stem: str, suffix: str) -> Path:
        """OUT/<stem>.<suffix> for the target's own outputs, OUT/<stem>-<teacher>.<suffix> otherwise."""
        a = self.args
        name = Path(a.teacher).name if a.teacher else ""
        if a.teacher_quantization != "none":
            name = f"{name or Path(a.target).name}-{a.teacher_quantization}"
        return self.out / (f"{stem}-{name}.{suffix}" if name else f"{stem}.{suffix}")

    def continuations(self, tokenizer_dir: Path) -> list[Example]:
        a = self.args
        path = Path(a.continuations).expanduser() if a.continuations else self._teacher_file("continuations", "jsonl")
        sources = list(a.dataset) + [f"file:{f}" for f in a.prompts]
        if not sources and not path.is_file():
            sources = list(DEFAULT_DATASETS)
        if not sources:
            examples = read_continuations(path)
            if not examples:
                raise SpecfleetError(f"{path} holds no continuations; give --dataset or --prompts to generate some")
            return examples
        prompts, text_only = self.prompts(load_tokenizer(tokenizer_dir), sources)
        done = {ex.id for ex in read_continuations(path)}
        llm = None
        if any(pid not in done for pid, _ in prompts):
            from specfleet.llm import LLM

            llm = LLM.from_model(self.teacher_model(), load_tokenizer(tokenizer_dir), None, name=a.teacher or a.target,
                                 dtype=self.dtype, device=str(self.device), max_num_seqs=a.gen_batch)
        t0 = time.perf_counter()
        examples = generate_continuations(llm, prompts, a.max_new_tokens, path, a.gen_batch)
        self.timings["generation_s"] = time.perf_counter() - t0
        return examples + [Example(pid, ids, []) for pid, ids in text_only]

    def prompts(self, tokenizer, sources: list[str]) -> tuple[list, list]:
        """(id, prompt token ids) from each source, chat data through the target's chat template (as
        LLM.chat does): the prompts to continue, and the text-only prompts after them."""
        from specfleet.bench.datasets import iter_prompts, select

        a = self.args
        to_continue: list[tuple[str, list[int]]] = []
        text_only: list[tuple[str, list[int]]] = []
        for src in sources:
            prompts, is_chat = iter_prompts(src)

            def encode(p, is_chat=is_chat) -> list[int]:
                if not is_chat:
                    return tokenizer.encode(p.text, add_special_tokens=True)
                text = tokenizer.apply_chat_template(p.as_messages(), tokenize=False, add_generation_prompt=True)
                return tokenizer.encode(text, add_special_tokens=False)

            chosen = select(prompts, a.num_prompts + a.num_text_prompts, shuffle_seed=a.seed,
                            keep=lambda p: len(encode(p)) <= a.max_prompt_tokens)
            label = Path(src[5:]).name if src.startswith("file:") else src
            pairs = [(f"{label}:{p.prompt_id}", encode(p)) for p in chosen]
            to_continue += pairs[:a.num_prompts]
            text_only += pairs[a.num_prompts:]
        return to_continue, text_only

    # -- model -----------------------------------------------------------------------------------
    def build_student(self, train_ex: list[Example]):
        a, target_cfg = self.args, self.target_cfg
        init = a.target if a.init_from == "target" else a.init_from
        source = None if init == "none" else load_source(init)
        init_name = "none" if source is None else canonical_model(init)
        spec = make_spec(target_cfg, source.config if source else None, init_name,
                         a.layers, a.init_layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab_top,
                         a.freeze_embeddings, a.freeze_head)
        vocab_ids = None
        if spec.vocab_size < target_cfg.vocab_size:  # a resumed run keeps the vocabulary it trained on
            vocab_ids = self.saved["vocab_ids"] if self.saved is not None else select_vocab(
                train_ex, spec.vocab_size, target_cfg.vocab_size, target_cfg.eos_token_ids)
        student = build_student(spec, vocab_ids, source.weights if source else None,
                                source.config if source else None, a.seed)
        n_train = sum(p.numel() for p in student.parameters() if p.requires_grad)
        logger.info("student: %d layers, width %d, head over %d tokens, %.1fM trainable parameters",
                    spec.model_config().num_layers, spec.model_config().hidden_size, spec.vocab_size, n_train / 1e6)
        return student

    def teacher(self, train_seqs):
        a = self.args
        if a.kl_weight <= 0 and not a.label_prompts:
            return None
        if a.kl_source == "online":
            model = self.teacher_model()
            return lambda seqs, ids, mask: teacher_topk(model, ids, mask, a.kl_top_k)
        self.out.mkdir(parents=True, exist_ok=True)
        cache = TopKCache(self._teacher_file("teacher_topk", "pt"), a.kl_top_k)
        t0 = time.perf_counter()
        cache.fill(self.teacher_model, train_seqs, a.batch_tokens)
        self.timings["teacher_topk_s"] = time.perf_counter() - t0
        return lambda seqs, ids, mask: cache.lookup(seqs)
