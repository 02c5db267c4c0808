"""Train glm52-tiny, the bundled toy model with the exact GLM-5.2 architecture, on 2 CPU cores.

    python tools/train_tiny_model.py --out models/glm52-tiny [--steps 700]

Deterministic (fixed seeds, fixed data order). Corpus: the running interpreter's standard library
plus generated agent chats (tools/tiny_corpus.py); tokenizer: byte-level BPE (tools/tiny_tokenizer.py).
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
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_corpus  # noqa: E402
import tiny_tokenizer  # noqa: E402

from glmserve.model.config import GlmConfig  # noqa: E402
from glmserve.model.forward_batch import ForwardBatch  # noqa: E402
from glmserve.model.glm_model import GlmForCausalLM, init_random, with_input_ids  # noqa: E402
from glmserve.model.greedy import greedy_generate  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.model.moe import TopkRouter  # noqa: E402
from glmserve.model.saver import save_model  # noqa: E402
from glmserve.text.special_tokens import ASSISTANT, EOS_TOKENS, SPECIAL_TOKENS  # noqa: E402
from glmserve.text.tool_calls import parse_tool_calls  # noqa: E402

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

SEQ_LEN = 384
BATCH = 8
DENSE_FRACTION = 0.3  # DSA warm-up share of the steps
MTP_WEIGHT = 0.3
INDEXER_WEIGHT = 0.1
BIAS_STEP = 1e-2
CHAT_SHARE = 0.4  # fraction of training windows drawn from chats


def log(msg: str) -> None:
    print(msg, flush=True)


def build_tokenizer(out: Path, n_chats: int):
    code = tiny_corpus.stdlib_texts("train")
    chats = tiny_corpus.chat_transcripts(n_chats, seed=1)
    tok = tiny_tokenizer.train_tokenizer(code + chats, vocab_size=TINY_CONFIG["vocab_size"])
    tiny_tokenizer.save_tokenizer(tok, out, model_max_length=TINY_CONFIG["max_position_embeddings"])
    return tok, code, chats


def token_stream(tok, texts: list[str], eos: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def sample_windows(streams: list[torch.Tensor], weights: list[float], rng: random.Random, n: int, length: int):
    rows = []
    for _ in range(n):
        stream = rng.choices(streams, weights)[0]
        start = rng.randrange(0, len(stream) - length)
        rows.append(stream[start : start + length])
    return torch.stack(rows)


def indexer_kl(records) -> torch.Tensor:
    """KL(attention || indexer) per query, averaged: the indexer learns where attention goes."""
    total = []
    for _, scores, probs in records:
        p = probs.detach()
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        log_q = F.log_softmax(scores, dim=-1).clamp_min(-1e4)
        total.append((p * (p.clamp_min(1e-12).log() - log_q)).sum(-1).mean())
    return torch.stack(total).mean()


def losses(model: GlmForCausalLM, windows: torch.Tensor, dense: bool, need_records: bool = True):
    """(lm loss, mtp loss, indexer loss) of windows [B, S + 2]."""
    b = windows.shape[0]
    seqs = [w[:SEQ_LEN].tolist() for w in windows]
    batch = ForwardBatch.build(seqs, [0] * b, [[0]] * b, block_size=SEQ_LEN)
    ctx = model.context(batch, None, dense_attention=dense, collect_indexer=need_records)
    hidden, _ = model(ctx)
    normed = model.final_norm(hidden)
    lm = F.cross_entropy(model.logits(normed), windows[:, 1 : SEQ_LEN + 1].reshape(-1))
    mtp_ctx = model.context(
        with_input_ids(batch, windows[:, 1 : SEQ_LEN + 1].reshape(-1)),
        None, dense_attention=dense, collect_indexer=need_records,
    )
    mtp_hidden, _ = model.mtp_step(mtp_ctx, normed)
    mtp = F.cross_entropy(model.mtp_logits(mtp_hidden), windows[:, 2 : SEQ_LEN + 2].reshape(-1))
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


def train(model, streams, weights, steps: int, peak_lr: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    load = ExpertLoad(model)
    history = []
    start = time.time()
    for step in range(steps):
        dense = step < int(steps * DENSE_FRACTION)
        windows = sample_windows(streams, weights, rng, BATCH, SEQ_LEN + 2)
        lm, mtp, ix = losses(model, windows, dense)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        opt.zero_grad(set_to_none=True)
        (lm + MTP_WEIGHT * mtp + INDEXER_WEIGHT * ix).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = load.rebalance()
        row = {"step": step, "lm": lm.item(), "mtp": mtp.item(), "indexer_kl": ix.item(), "dense": dense}
        if step % 10 == 0 or step == steps - 1:
            row["elapsed_s"] = round(time.time() - start, 1)
            history.append(row)
            log(
                f"step {step:4d} {'dense ' if dense else 'sparse'} lm {lm.item():.3f} mtp {mtp.item():.3f} "
                f"kl {ix.item():.3f} max-load/mean {imbalance:.2f} {time.time() - start:.0f}s"
            )
    return history


@torch.no_grad()
def evaluate(model, heldout: torch.Tensor, n_windows: int = 24) -> dict:
    """Held-out next-token loss and MTP top-1 agreement with the main model's greedy next token."""
    rng = random.Random(1234)
    windows = sample_windows([heldout], [1.0], rng, n_windows, SEQ_LEN + 2)
    lm_total, agree, count = 0.0, 0, 0
    for chunk in windows.split(BATCH):
        lm, _, _ = losses(model, chunk, dense=False, need_records=False)
        lm_total += lm.item() * len(chunk)
        b = chunk.shape[0]
        batch = ForwardBatch.build([w[:SEQ_LEN].tolist() for w in chunk], [0] * b, [[0]] * b, SEQ_LEN)
        hidden, _ = model(model.context(batch))
        normed = model.final_norm(hidden)
        main_next = model.logits(normed).argmax(-1).view(b, SEQ_LEN)
        mtp_ctx = model.context(with_input_ids(batch, chunk[:, 1 : SEQ_LEN + 1].reshape(-1)))
        draft = model.mtp_logits(model.mtp_step(mtp_ctx, normed)[0]).argmax(-1).view(b, SEQ_LEN)
        # MTP at t predicts t+2; the main model predicts t+2 at position t+1.
        agree += int((draft[:, :-1] == main_next[:, 1:]).sum())
        count += draft[:, :-1].numel()
    return {"heldout_loss": lm_total / len(windows), "mtp_top1_agreement": agree / count}


def tool_call_prompts(n: int, seed: int = 999) -> list[str]:
    """Unseen agent chats cut right after their first assistant tag (the first turn calls a tool)."""
    prompts = []
    for text in tiny_corpus.chat_transcripts(4 * n, seed=seed):
        head, sep, rest = text.partition(ASSISTANT + "\n")
        if sep and rest.startswith("<tool_call>"):
            prompts.append(head + sep)
        if len(prompts) == n:
            break
    return prompts


def evaluate_tool_calls(model, tok, eos_ids: list[int], n: int = 10) -> float:
    """Share of unseen chat prompts where greedy decoding emits at least one parseable tool call."""
    hits = 0
    for prompt in tool_call_prompts(n):
        out = greedy_generate(model, tok.encode(prompt).ids, max_new_tokens=64, stop_ids=eos_ids)
        text = tok.decode([t for t in out if t not in eos_ids], skip_special_tokens=False)
        hits += bool(parse_tool_calls(text).tool_calls)
    return hits / n


def write_config(out: Path, tok) -> None:
    config = dict(TINY_CONFIG)
    config["eos_token_id"] = [tok.token_to_id(t) for t in EOS_TOKENS]
    config["pad_token_id"] = tok.token_to_id("<|endoftext|>")
    config["bos_token_id"] = None
    GlmConfig.from_dict(config)  # validates
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/glm52-tiny"))
    parser.add_argument("--steps", type=int, default=620)
    parser.add_argument("--chats", type=int, default=6000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    tok, code, chats = build_tokenizer(args.out, args.chats)
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    streams = [token_stream(tok, code, eos), token_stream(tok, chats, eos)]
    heldout = token_stream(tok, tiny_corpus.stdlib_texts("heldout"), eos)
    log(f"tokenizer + corpus: {time.time() - t0:.0f}s; tokens code {len(streams[0]):,} chat {len(streams[1]):,} "
        f"heldout {len(heldout):,}")
    write_config(args.out, tok)
    config = GlmConfig.from_pretrained(args.out)
    model = GlmForCausalLM(config)
    init_random(model, std=TINY_CONFIG["initializer_range"], generator=torch.Generator().manual_seed(args.seed))
    log(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    history = train(model, streams, [1 - CHAT_SHARE, CHAT_SHARE], args.steps, args.lr, args.seed)
    metrics = finalize(model, args.out, tok, heldout)
    metrics.update(wall_time_s=round(time.time() - t0, 1), steps=args.steps, tokens_seen=args.steps * BATCH * SEQ_LEN)
    (args.out / "training_log.json").write_text(json.dumps({"metrics": metrics, "history": history}, indent=1))
    log(json.dumps(metrics))


def finalize(model: GlmForCausalLM, out: Path, tok, heldout: torch.Tensor) -> dict:
    """Store the weights in bfloat16 (what fits the 50 MB budget) and evaluate what users will load."""
    save_model(model, out, dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shipped = load_model(out)
    metrics = evaluate(shipped, heldout)
    metrics["tool_call_rate"] = evaluate_tool_calls(shipped, tok, list(shipped.config.eos_token_ids))
    return metrics


if __name__ == "__main__":
    main()
