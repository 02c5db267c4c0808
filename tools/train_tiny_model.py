"""Train glm52-tiny, the bundled toy model with the exact GLM-5.2 architecture, on 2 CPU cores.

    python tools/train_tiny_model.py --out models/glm52-tiny --tokenizer-from models/glm52-tiny

Deterministic (fixed seeds, fixed data order). Corpus: the running interpreter's standard library
plus generated agent chats (tools/tiny_corpus.py); tokenizer: byte-level BPE (tools/tiny_tokenizer.py),
trained here or, with --tokenizer-from, reused (the bundled model keeps the tokenizer of its first
version, so token ids do not change between retrains). Code windows start anywhere in the code stream
and count every token; chat windows start at a chat and count the assistant's output fully and the
rest (tool lists, asks, tool results) with --context-weight. From --late-from of the steps on, chat
windows get a larger share (--late-chat-share): the model learns code first, then mostly the chats.
Objective: next-token loss + MTP loss (weight 0.3) + the DSA indexer's distillation loss: KL from the
(detached) attention distribution to the indexer's softmax, first with dense attention (warm-up), then
with attention restricted to the indexer's top-k (sparse phase, KL over the selected tokens).
Router balance is aux-loss-free: the expert score bias moves against each expert's load.
Users and CI never run this: the result is committed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `tools.*`

from glmserve.model.config import GlmConfig  # noqa: E402
from glmserve.model.forward_batch import ForwardBatch  # noqa: E402
from glmserve.model.glm_model import GlmForCausalLM, init_random, with_input_ids  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.model.moe import TopkRouter  # noqa: E402
from glmserve.model.saver import save_model  # noqa: E402
from glmserve.text.special_tokens import EOS_TOKENS, SPECIAL_TOKENS  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402
from glmserve.text.tool_calls import parse_tool_calls  # noqa: E402
from tools import tiny_corpus, tiny_tokenizer, tool_use_eval  # noqa: E402
from tools.tiny_training_data import Stream, chat_stream, code_stream, sample_windows  # noqa: E402

TINY_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 48,
    "qk_rope_head_dim": 16,
    "v_head_dim": 64,
    "head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "index_topk": 128,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "num_nextn_predict_layers": 1,
    "index_share_for_mtp_iteration": True,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0},
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}

DENSE_FRACTION = 0.3  # DSA warm-up share of the steps
MTP_WEIGHT = 0.3
INDEXER_WEIGHT = 0.1
BIAS_STEP = 1e-2
EVAL_LEN = 384  # held-out windows (the numbers of the first model card were measured on these)


def log(msg: str) -> None:
    print(msg, flush=True)


def build_tokenizer(out: Path, reuse: Path | None, n_chats: int) -> HFTokenizer:
    if reuse is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (reuse / name).resolve() != (out / name).resolve():
                shutil.copy(reuse / name, out / name)
        return HFTokenizer.from_file(str(out / "tokenizer.json"))
    texts = tiny_corpus.stdlib_texts("train") + tiny_corpus.chat_transcripts(n_chats, seed=1)
    tok = tiny_tokenizer.train_tokenizer(texts, vocab_size=TINY_CONFIG["vocab_size"])
    tiny_tokenizer.save_tokenizer(tok, out, model_max_length=TINY_CONFIG["max_position_embeddings"])
    return tok


def indexer_kl(records) -> torch.Tensor:
    """KL(attention || indexer) per query, averaged: the indexer learns where attention goes."""
    total = []
    for _, scores, probs in records:
        p = probs.detach()
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        log_q = F.log_softmax(scores, dim=-1).clamp_min(-1e4)
        total.append((p * (p.clamp_min(1e-12).log() - log_q)).sum(-1).mean())
    return torch.stack(total).mean()


def _weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits, targets, reduction="none")
    return (ce * weights).sum() / weights.sum().clamp_min(1e-6)


def losses(model: GlmForCausalLM, windows: torch.Tensor, weights: torch.Tensor | None, dense: bool,
           need_records: bool = True):
    """(lm loss, mtp loss, indexer loss) of windows [B, S + 2]; weights [B, S + 2] per target token."""
    b, seq = windows.shape[0], windows.shape[1] - 2
    if weights is None:
        weights = torch.ones(windows.shape)
    batch = ForwardBatch.build([w[:seq].tolist() for w in windows], [0] * b, [[0]] * b, block_size=seq)
    ctx = model.context(batch, None, dense_attention=dense, collect_indexer=need_records)
    hidden, _ = model(ctx)
    normed = model.final_norm(hidden)
    lm = _weighted_ce(model.logits(normed), windows[:, 1 : seq + 1].reshape(-1), weights[:, 1 : seq + 1].reshape(-1))
    mtp_ctx = model.context(
        with_input_ids(batch, windows[:, 1 : seq + 1].reshape(-1)),
        None, dense_attention=dense, collect_indexer=need_records,
    )
    mtp_hidden, _ = model.mtp_step(mtp_ctx, normed)
    mtp = _weighted_ce(
        model.mtp_logits(mtp_hidden), windows[:, 2 : seq + 2].reshape(-1), weights[:, 2 : seq + 2].reshape(-1)
    )
    records = ctx.indexer_records + mtp_ctx.indexer_records
    ix = indexer_kl(records) if need_records else torch.zeros(())
    return lm, mtp, ix


class ExpertLoad:
    """Counts routed tokens per expert (forward hooks) and moves each router's bias against its load."""

    def __init__(self, model: GlmForCausalLM):
        self.counts: dict[TopkRouter, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, TopkRouter):
                module.register_forward_hook(self._hook)

    def _hook(self, module, _inputs, output) -> None:
        ids = output[2].reshape(-1)
        counts = torch.bincount(ids, minlength=module.weight.shape[0]).float()
        self.counts[module] = self.counts.get(module, 0) + counts

    @torch.no_grad()
    def rebalance(self) -> float:
        worst = 0.0
        for router, counts in self.counts.items():
            mean = counts.mean()
            router.e_score_correction_bias += BIAS_STEP * torch.sign(mean - counts)
            worst = max(worst, float(counts.max() / mean))
        self.counts.clear()
        return worst


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(steps // 20, 1)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def shares_at(step: int, shares: list[float], args) -> list[float]:
    """[code, chat] shares of the windows: from `--late-from` of the steps on, chats get `--late-chat-share`
    (a fine-tuning phase on chats once the code model has formed; the data order before it is unchanged)."""
    if args.late_chat_share is None or step < int(args.steps * args.late_from):
        return shares
    return [1 - args.late_chat_share, args.late_chat_share]


def train(model, streams: list[Stream], shares: list[float], args) -> list[dict]:
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    load = ExpertLoad(model)
    state = {"step": 0, "history": [], "wall_s": 0.0, "cpu_s": 0.0}
    if args.checkpoint is not None and args.checkpoint.exists():
        state = _resume(args.checkpoint, model, opt, rng)
        log(f"resumed at step {state['step']} ({state['wall_s']:.0f}s wall, {state['cpu_s']:.0f}s cpu so far)")
    history = state["history"]
    start, cpu_start = time.time() - state["wall_s"], time.process_time() - state["cpu_s"]
    for step in range(state["step"], args.steps):
        dense = step < int(args.steps * DENSE_FRACTION)
        windows, weights = sample_windows(streams, shares_at(step, shares, args), rng, args.batch, args.seq_len + 2)
        lm, mtp, ix = losses(model, windows, weights, dense)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        opt.zero_grad(set_to_none=True)
        (lm + MTP_WEIGHT * mtp + INDEXER_WEIGHT * ix).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = load.rebalance()
        if step % 10 == 0 or step == args.steps - 1:
            wall, cpu = time.time() - start, time.process_time() - cpu_start
            row = {"step": step, "lm": lm.item(), "mtp": mtp.item(), "indexer_kl": ix.item(), "dense": dense,
                   "elapsed_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_avg": os.getloadavg()[0]}
            history.append(row)
            log(
                f"step {step:4d} {'dense ' if dense else 'sparse'} lm {lm.item():.3f} mtp {mtp.item():.3f} "
                f"kl {ix.item():.3f} max-load/mean {imbalance:.2f} {wall:.0f}s wall, {cpu:.0f}s cpu, "
                f"load {row['load_avg']:.1f}"
            )
        if args.checkpoint is not None and (step + 1) % args.checkpoint_every == 0:
            _save(args.checkpoint, model, opt, rng, step + 1, history, time.time() - start,
                  time.process_time() - cpu_start)
    return history


def _save(path: Path, model, opt, rng: random.Random, step: int, history, wall_s: float, cpu_s: float) -> None:
    """Everything a resumed run needs to continue exactly (weights, optimizer, both RNGs, the step)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate(),
                "torch_rng": torch.get_rng_state(), "step": step, "history": history, "wall_s": wall_s,
                "cpu_s": cpu_s}, tmp)
    tmp.replace(path)


def _resume(path: Path, model, opt, rng: random.Random) -> dict:
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    rng.setstate(saved["rng"])
    torch.set_rng_state(saved["torch_rng"])
    return saved


@torch.no_grad()
def evaluate(model, heldout: Stream, n_windows: int = 24, seq: int = EVAL_LEN) -> dict:
    """Held-out next-token loss and MTP top-1 agreement with the main model's greedy next token."""
    rng = random.Random(1234)
    windows, _ = sample_windows([heldout], [1.0], rng, n_windows, seq + 2)
    lm_total, agree, count = 0.0, 0, 0
    for chunk in windows.split(8):
        lm, _, _ = losses(model, chunk, None, dense=False, need_records=False)
        lm_total += lm.item() * len(chunk)
        b = chunk.shape[0]
        batch = ForwardBatch.build([w[:seq].tolist() for w in chunk], [0] * b, [[0]] * b, seq)
        hidden, _ = model(model.context(batch))
        normed = model.final_norm(hidden)
        main_next = model.logits(normed).argmax(-1).view(b, seq)
        mtp_ctx = model.context(with_input_ids(batch, chunk[:, 1 : seq + 1].reshape(-1)))
        draft = model.mtp_logits(model.mtp_step(mtp_ctx, normed)[0]).argmax(-1).view(b, seq)
        # MTP at t predicts t+2; the main model predicts t+2 at position t+1.
        agree += int((draft[:, :-1] == main_next[:, 1:]).sum())
        count += draft[:, :-1].numel()
    return {"heldout_loss": lm_total / len(windows), "mtp_top1_agreement": agree / count}


def dev_decisions(model, tok: Tokenizer, n: int = 96, seed: int = 999) -> dict:
    """First decisions on unseen generated chats (in-distribution phrasings, fresh draws): how often
    greedy decoding calls a tool where the transcript does, and where it answers in text."""
    prompts, wants = [], []
    for text, spans in tiny_corpus.chat_examples(n, seed=seed):
        start, end = spans[0]
        prompts.append(tok.encode(text[:start]))
        wants.append("<tool_call>" in text[start:end])
    stops = list(tok.eos_token_ids)
    outs = tool_use_eval.batched_greedy(model, prompts, 48, stops)
    called = [bool(parse_tool_calls(tok.decode([t for t in o if t not in stops])).tool_calls) for o in outs]
    hits = sum(c for c, w in zip(called, wants, strict=True) if w)
    false = sum(c for c, w in zip(called, wants, strict=True) if not w)
    return {"dev_tool_asks_called": hits / max(sum(wants), 1),
            "dev_plain_asks_called": false / max(len(wants) - sum(wants), 1)}


def write_config(out: Path, tok) -> None:
    config = dict(TINY_CONFIG)
    config["eos_token_id"] = [tok.token_to_id(t) for t in EOS_TOKENS]
    config["pad_token_id"] = tok.token_to_id("<|endoftext|>")
    config["bos_token_id"] = None
    GlmConfig.from_dict(config)  # validates
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/glm52-tiny"))
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="reuse this dir's tokenizer")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--chats", type=int, default=8000)
    parser.add_argument("--chat-share", type=float, default=0.5, help="fraction of windows drawn from chats")
    parser.add_argument("--late-chat-share", type=float, default=None, help="chat share from --late-from on "
                        "(default: --chat-share throughout)")
    parser.add_argument("--late-from", type=float, default=0.5, help="fraction of the steps where the late "
                        "chat share starts")
    parser.add_argument("--context-weight", type=float, default=0.1, help="loss weight of chat tokens the "
                        "assistant does not write")
    parser.add_argument("--decision-weight", type=float, default=1.0, help="loss weight of the first token "
                        "of each assistant turn (a call or text)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint", type=Path, default=None, help="save here every --checkpoint-every "
                        "steps and resume from it when it exists (a run may span several sittings)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--mix", type=json.loads, default={}, help="tiny_corpus.Mix fields as JSON")
    parser.add_argument("--skip-eval", action="store_true", help="smoke runs: no evaluation at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args.out, args.tokenizer_from, args.chats)
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    mix = tiny_corpus.Mix(**{f.name: args.mix[f.name] for f in fields(tiny_corpus.Mix) if f.name in args.mix})
    examples = tiny_corpus.chat_examples(args.chats, seed=0, mix=mix)
    streams = [code_stream(tok, tiny_corpus.stdlib_texts("train"), eos),
               chat_stream(tok, examples, args.context_weight, args.decision_weight)]
    heldout = code_stream(tok, tiny_corpus.stdlib_texts("heldout"), eos)
    log(f"tokenizer + corpus: {time.time() - t0:.0f}s; tokens code {len(streams[0].ids):,} "
        f"chat {len(streams[1].ids):,} heldout {len(heldout.ids):,}")
    write_config(args.out, tok)
    config = GlmConfig.from_pretrained(args.out)
    model = GlmForCausalLM(config)
    init_random(model, std=TINY_CONFIG["initializer_range"], generator=torch.Generator().manual_seed(args.seed))
    log(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    history = train(model, streams, [1 - args.chat_share, args.chat_share], args)
    metrics = finalize(model, args.out, heldout, skip_eval=args.skip_eval)
    metrics.update(wall_time_s=round(time.time() - t0, 1), train_cpu_s=history[-1]["cpu_s"],
                   train_wall_s=history[-1]["elapsed_s"], steps=args.steps,
                   tokens_seen=args.steps * args.batch * args.seq_len,
                   settings={k: str(v) for k, v in vars(args).items()})
    (args.out / "training_log.json").write_text(json.dumps({"metrics": metrics, "history": history}, indent=1))
    log(json.dumps(metrics))


def finalize(model: GlmForCausalLM, out: Path, heldout: Stream, skip_eval: bool = False) -> dict:
    """Store the weights in bfloat16 (what fits the 50 MB budget) and evaluate what users will load."""
    save_model(model, out, dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if skip_eval:
        return {}
    shipped, tok = load_model(out), Tokenizer.from_dir(out)
    metrics = evaluate(shipped, heldout)
    metrics.update(dev_decisions(shipped, tok))
    metrics.update(tool_use_eval.evaluate_tool_use(shipped, tok).rates())
    return metrics


if __name__ == "__main__":
    main()
