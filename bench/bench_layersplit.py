"""LayerSplit prefill: TTFT with 1 vs 2 stages, weights and peak memory per stage, KV transfer left exposed.

Real processes on 127.0.0.1, each with OMP_NUM_THREADS=1 (one thread per stage), `--transfer` as
given; TTFT is measured at the decode worker's Generate (call to the first token event: prefill
through every stage, and the KV of every stage in decode's blocks).

(a) TTFT: the bundled model, a one-stage and a two-stage replica (the planner's split), in rounds
    of every prompt length, the systems in rotating order; fresh prompts (no prefix hit). Ratios are
    taken within a round (2 stages vs 1), medians over rounds.
(b) Memory: replicas of 1, 2 and 4 stages (4: two layers each), one 4K prompt each; per stage the
    bytes of the weights it loaded (its layers only) and its peak resident memory (VmHWM).
(c) Exposed KV transfer: a random config with GLM-5.2's KV widths (kv_lora_rank 512, rope 64, indexer
    keys 128, float32 cache) and small compute elsewhere, so the transfer is not negligible; a
    two-stage replica streaming its KV per chunk. From the stages' timestamps (the head's
    glmserve_layersplit_kv_transfer_* histograms): the wall time KV writes were in flight, the part
    after the last chunk was computed, and the share hidden behind compute.

    python bench/bench_layersplit.py [--lengths 4096,16384 --rounds 3 --transfer auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_host_tier import Proc, free_port, source_tokens  # noqa: E402
from bench.common import int_list, load_average, markdown_table, print_header, rotated  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.model.config import GlmConfig  # noqa: E402
from glmserve.model.glm_model import GlmForCausalLM, init_random  # noqa: E402
from glmserve.model.layer_split import parse_layer_split, plan_layer_split  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.model.saver import save_model  # noqa: E402
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb  # noqa: E402
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb  # noqa: E402
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc  # noqa: E402
from glmserve.services.generation_proto import sampling_to_proto as to_proto  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
# GLM-5.2's KV widths and indexer schedule; the rest small, so compute does not drown the transfer.
KV_WIDE = {
    "model_type": "glm_moe_dsa", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "q_lora_rank": 128,
    "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 4, "index_topk_freq": 4,
    "index_skip_topk_offset": 3, "num_nextn_predict_layers": 1, "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8e6}, "eos_token_id": [0],
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--lengths", type=int_list, default=[4096, 16384], help="prompt tokens (a) and (c)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of (a)")
    p.add_argument("--memory-tokens", type=int, default=4096, help="prompt of (b)")
    p.add_argument("--transfer", choices=("auto", "nixl", "tcp"), default="auto")
    p.add_argument("--skip", default="", help="comma list of parts to skip: ttft,memory,exposure")
    return p.parse_args(argv)


class Replica:
    """One LayerSplit prefill replica: a process per stage, each told every stage's address."""

    def __init__(self, name: str, model: str, split: str, transfer: str, logs: Path, kv_bytes: int) -> None:
        n = len(split.split(","))
        addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        self.stages = [Proc(f"{name}-s{k}", ["glmserve.services.prefill.main", "--model", model, "--host",
                                              "127.0.0.1", "--port", a.rsplit(":", 1)[1], "--worker-id", name,
                                              "--transfer", transfer, "--kv-cache-bytes", str(kv_bytes),
                                              "--stage-index", str(k), "--stage-addresses", ",".join(addresses),
                                              "--layer-split", split], logs)
                       for k, a in enumerate(addresses)]
        self.address = addresses[0]

    def ready(self) -> Replica:
        for stage in self.stages:
            stage.ready()
        return self

    def peak_rss(self) -> list[int]:
        out = []
        for stage in self.stages:
            status = Path(f"/proc/{stage.proc.pid}/status").read_text()
            out.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024)
        return out

    def cpu_seconds(self) -> float:
        total = 0.0
        for stage in self.stages:
            fields = Path(f"/proc/{stage.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / 100
        return total

    def stop(self) -> None:
        for stage in self.stages:
            stage.stop()


def decode_worker(model: str, transfer: str, logs: Path, kv_bytes: int) -> Proc:
    # A cold 16K-token prefill on one CPU thread per stage takes minutes: past decode's default deadline.
    return Proc("decode", ["glmserve.services.decode.main", "--model", model, "--host", "127.0.0.1", "--port", "0",
                           "--worker-id", "decode", "--transfer", transfer, "--kv-cache-bytes", str(kv_bytes),
                           "--prefill-timeout-s", "3000"], logs).ready()


def ttft(decode: Proc, prefill: str, rid: str, prompt: list[int]) -> float:
    async def go() -> float:
        async with grpc.aio.insecure_channel(decode.address) as channel:
            request = decode_pb.GenerateRequest(transfer=common_pb.TransferId(request_id=rid, generation=1),
                                                prompt_ids=prompt, sampling=to_proto(FIRST_TOKEN),
                                                prefill_target=prefill)
            start, first = time.perf_counter(), None
            async for event in decode_grpc.DecodeStub(channel).Generate(request, timeout=3000):
                if event.token_ids and first is None:
                    first = time.perf_counter() - start
                if event.finish_reason and event.error:
                    raise RuntimeError(f"{rid}: {event.error}")
            assert first is not None
            return first

    return asyncio.run(go())


def kv_bytes_for(model: str, tokens: int) -> int:
    from glmserve.model.kv_layout import KVLayout

    layout = KVLayout.for_config(GlmConfig.from_pretrained(model), 64, dtype=torch.float32)
    return (tokens // 64 + 4) * layout.bytes_per_block * 2


def run_ttft(args: argparse.Namespace, logs: Path, source: list[int]) -> str:
    config = GlmConfig.from_pretrained(args.model)
    splits = {"1 stage": f"0-{config.num_hidden_layers - 1}", "2 stages": plan_layer_split(config, 2).spec()}
    kv = kv_bytes_for(args.model, max(args.lengths))
    decode = decode_worker(args.model, args.transfer, logs, kv)
    replicas = {name: Replica(name.replace(" ", ""), args.model, split, args.transfer, logs, kv)
                for name, split in splits.items()}
    samples: dict[tuple[int, str], list[float]] = {}
    try:
        for r in replicas.values():
            r.ready()
        for name, r in replicas.items():
            ttft(decode, r.address, f"warmup-{name}", source[:256][::-1])
        for rnd in range(args.rounds):
            for n in args.lengths:
                for i, name in enumerate(rotated(list(replicas), rnd)):
                    prompt = [10 + 2 * rnd + i] + source[1:n]  # a new first token: no prefix hit
                    seconds = ttft(decode, replicas[name].address, f"{name}-{n}-{rnd}", prompt)
                    samples.setdefault((n, name), []).append(seconds)
                    print(f"round {rnd} {n} tokens {name}: {seconds:.2f} s (load {load_average()})", file=sys.stderr)
    finally:
        for r in replicas.values():
            r.stop()
        decode.stop()
    rows = []
    for n in args.lengths:
        one, two = samples[(n, "1 stage")], samples[(n, "2 stages")]
        ratios = [a / b for a, b in zip(one, two, strict=True)]
        rows.append([n, f"{statistics.median(one):.2f}", f"{statistics.median(two):.2f}",
                     f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"])
    table = markdown_table(["prompt tokens", "TTFT 1 stage s", "TTFT 2 stages s", "speed-up (range)"], rows)
    return (f"### (a) TTFT, `{args.model}`, splits {splits['1 stage']} vs {splits['2 stages']}, medians of "
            f"{args.rounds} rounds\n\n{table}\n")


def weight_bytes(model_dir: str, layers: range) -> int:
    model = load_model(model_dir, layers=layers)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_memory(args: argparse.Namespace, logs: Path, source: list[int]) -> str:
    config = GlmConfig.from_pretrained(args.model)
    n = config.num_hidden_layers
    splits = [f"0-{n - 1}", plan_layer_split(config, 2).spec(), ",".join(f"{i}-{i + 1}" for i in range(0, n, 2))]
    kv = kv_bytes_for(args.model, args.memory_tokens)
    whole = weight_bytes(args.model, range(n))
    decode = decode_worker(args.model, args.transfer, logs, kv)
    rows = []
    try:
        for split in splits:
            replica = Replica(f"mem{len(split.split(','))}", args.model, split, args.transfer, logs, kv).ready()
            try:
                ttft(decode, replica.address, f"mem-{split}", source[: args.memory_tokens])
                peaks = replica.peak_rss()
            finally:
                replica.stop()
            for k, layers in enumerate(parse_layer_split(split, config).ranges):
                w = weight_bytes(args.model, layers)
                rows.append([len(peaks), k, f"{layers.start}-{layers.stop - 1}", f"{w / 2**20:.1f}",
                             f"{w / whole:.0%}", f"{peaks[k] / 2**20:.0f}"])
    finally:
        decode.stop()
    table = markdown_table(["stages", "stage", "layers", "weights MiB", "of the whole", "peak RSS MiB"], rows)
    return (f"### (b) Weights and peak memory per stage, one {args.memory_tokens}-token prompt "
            f"(`--kv-cache-bytes {kv}` each)\n\n{table}\n")


def kv_wide_model(logs: Path, bundled: str) -> str:
    path = logs / "kv-wide"
    path.mkdir()
    config = GlmConfig.from_dict(KV_WIDE)
    model = GlmForCausalLM(config)
    init_random(model, std=0.02, generator=torch.Generator().manual_seed(0))
    save_model(model, path)
    (path / "config.json").write_text(json.dumps({**KV_WIDE, "architectures": ["GlmMoeDsaForCausalLM"]}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the workers read them
        shutil.copy(Path(bundled) / name, path / name)
    return str(path)


def run_exposure(args: argparse.Namespace, logs: Path, source: list[int]) -> str:
    model = kv_wide_model(logs, args.model)
    config = GlmConfig.from_pretrained(model)
    split = plan_layer_split(config, 2).spec()
    kv = kv_bytes_for(model, max(args.lengths))
    decode = decode_worker(model, args.transfer, logs, kv)
    replica = Replica("wide", model, split, args.transfer, logs, kv).ready()
    head = replica.stages[0]
    rows = []
    try:
        ttft(decode, replica.address, "warmup", source[:256][::-1])
        for i, n in enumerate(args.lengths):
            before = [head.metric(f"glmserve_layersplit_kv_transfer{s}_seconds_sum") for s in ("", "_exposed")]
            seconds = ttft(decode, replica.address, f"wide-{n}", [20 + i] + source[1:n])
            busy, exposed = (head.metric(f"glmserve_layersplit_kv_transfer{s}_seconds_sum") - b
                             for s, b in zip(("", "_exposed"), before, strict=True))
            rows.append([n, f"{seconds:.2f}", f"{busy * 1e3:.0f}", f"{exposed * 1e3:.1f}", f"{1 - exposed / busy:.1%}"])
        moved = head.metric("glmserve_kv_transfer_bytes_total")
    finally:
        replica.stop()
        decode.stop()
    table = markdown_table(["prompt tokens", "TTFT s", "KV writes in flight ms", "exposed after compute ms",
                            "hidden"], rows)
    return (f"### (c) KV transfer left on the critical path, random config with GLM-5.2's KV widths, split "
            f"{split}, streamed per 2048-token chunk\n\n{table}\n\n{moved / 2**20:.0f} MiB of KV written to "
            f"decode in all (float32 cache).\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    skip = set(args.skip.split(","))
    source = source_tokens(args.model, max([*args.lengths, args.memory_tokens]) + 64)
    load_start, started = load_average(), time.perf_counter()
    parts = []
    with tempfile.TemporaryDirectory(prefix="bench-layersplit-") as tmp:
        for name, part in (("ttft", run_ttft), ("memory", run_memory), ("exposure", run_exposure)):
            if name not in skip:
                parts.append(part(args, Path(tmp), source))
    command = " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)])
    print_header("LayerSplit prefill: 1 vs 2 stages, memory per stage, exposed KV transfer", command)
    print(f"- run: {time.perf_counter() - started:.0f} s wall, load average {load_start} at start, "
          f"{load_average()} at end (2 cores); every process OMP_NUM_THREADS=1\n")
    print("\n".join(parts))


if __name__ == "__main__":
    main()
