"""Chaos soak: minutes of load, cancellation storms and random kill -9 on one `glmserve serve`.

The platform (kvstore with a host tier, `--prefill` prefill and `--decode` decode workers, the
router; fixed metrics ports so every worker can be scraped across restarts) runs under `--clients`
streaming clients for `--minutes`. Each request is a greedy chat completion of one of `--prompts`
fixed prompts (`ignore_eos`, `--max-tokens`), whose unloaded answer is measured first, one at a
time. A share `--cancel` of the requests is cancelled by its client at a random point (before the
first token, or after a random number of chunks); every `--storm-every` seconds a storm of
`--storm-size` requests starts and is cancelled at once. Every `--kill-every` seconds (jittered),
once the platform is whole again, one child of the `--victims` roles is killed with SIGKILL; the
launcher restarts it.

Reported: requests completed (and whether each greedy answer equals the unloaded one), refused
before any byte with 429/503 and `Retry-After` (while a role has no healthy worker; the client
waits the second it says), failed (and whether each failure ended within `--blame-s` of a kill,
i.e. was on the killed process, or not), streams migrated to another decode worker,
cancelled by clients, kills and restarts, leaked KV blocks (every worker's used blocks once the
load stopped: must be 0), stale-stamp rejections (invariant 3; summed over each process's life).

    python bench/bench_chaos_soak.py [--minutes 5 --clients 12 --kill-every 20 --victims decode,prefill,kvstore]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "glm52-tiny"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import load_average, markdown_table, print_header  # noqa: E402


class Platform:
    """`glmserve serve` as a subprocess; reads its stdout for pids, restarts and the URL."""

    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        self.metrics_base = args.metrics_base
        cmd = [sys.executable, "-m", "glmserve.cli", "serve", "--model", str(MODEL), "--port", "0",
               "--prefill-workers", str(args.prefill), "--decode-workers", str(args.decode),
               "--host-tier-bytes", str(64 << 20), "--drain-timeout", "5", "--max-restarts", "1000",
               "--max-restart-backoff", "2", "--metrics-port", str(args.metrics_base)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"}
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.pids: dict[str, int] = {}
        self.restarts: Counter[str] = Counter()
        self.back: threading.Event = threading.Event()
        self.url = ""
        started = threading.Event()
        threading.Thread(target=self._read, args=(started,), daemon=True).start()
        if not started.wait(600):
            raise RuntimeError("the platform did not start in 10 minutes")

    def _read(self, started: threading.Event) -> None:
        for line in self.proc.stdout:
            if m := re.search(r"glmserve: (\S+)\s+\S+\s+\(.*pid (\d+)\)", line):
                self.pids[m.group(1)] = int(m.group(2))
            elif m := re.search(r"glmserve: (\S+) restarted \(pid (\d+)", line):
                self.pids[m.group(1)] = int(m.group(2))
                self.restarts[m.group(1)] += 1
            elif re.search(r"glmserve: \S+ is back at", line):
                self.back.set()
            elif m := re.search(r"serving \S+ at (http://\S+)/v1", line):
                self.url = m.group(1)
                started.set()

    def children(self, roles: list[str]) -> list[str]:
        return [name for name in self.pids if name.rsplit("-", 1)[0] in roles]

    def kill(self, name: str) -> None:
        self.back.clear()
        os.kill(self.pids[name], signal.SIGKILL)

    def worker_metrics(self, index: int) -> dict[str, float]:
        """Unlabelled-by-us samples of the worker at metrics index ``index`` (prefill 1.., decode after)."""
        url = f"http://127.0.0.1:{self.metrics_base + index}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def router_metrics(self) -> dict[str, float]:
        """The router's samples, by name and labels (``name{k="v"}``)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {s.name + "".join(f"{{{k}={v!r}}}" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        finally:
            self.log.close()


@dataclass
class Tally:
    completed: int = 0
    exact: int = 0
    cancelled: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # 429 / 503 with Retry-After, by status
    failed_on_killed: int = 0
    failed_other: int = 0
    other_errors: list[str] = field(default_factory=list)
    kills: list[tuple[float, str]] = field(default_factory=list)
    stale: dict[tuple[int, float], float] = field(default_factory=dict)  # (worker, start time) -> max seen


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "json decoder parse scan string number array object value token buffer error".split()
    return [f"Explain {' '.join(rng.choice(words) for _ in range(rng.randrange(3, 40)))}." for _ in range(n)]


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, cancel_after: int | None) -> tuple[str, str]:
    """(outcome, text): outcome "completed", "cancelled" or "error: ..."."""
    text, chunks = "", 0
    try:
        stream = await client.chat.completions.create(
            model=MODEL.name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        async with stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                    chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return "cancelled", text  # leaving the block closes the connection
    except openai.APIStatusError as e:
        if e.status_code in (429, 503) and e.response.headers.get("retry-after"):
            return f"refused {e.status_code}", text  # before any byte: "come back later", honestly said
        return f"error: {e.status_code} {e.message}", text
    except openai.APIError as e:  # an error event inside a started stream
        return f"error: {e.message}", text
    except Exception as e:  # a cut connection: the thing that must never happen
        return f"error: {type(e).__name__}: {e}", text
    return "completed", text


def record(tally: Tally, outcome: str, text: str, reference: str, ended: float, blame_s: float) -> None:
    if outcome == "completed":
        tally.completed += 1
        tally.exact += text == reference
    elif outcome == "cancelled":
        tally.cancelled += 1
    elif outcome.startswith("refused"):
        tally.refused[outcome.split()[1]] += 1
    elif any(0 <= ended - t <= blame_s for t, _ in tally.kills):
        tally.failed_on_killed += 1
    else:
        tally.failed_other += 1
        tally.other_errors.append(outcome[:200])


async def client_loop(args, platform, refs, tally, deadline, rng) -> None:
    client = openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key="unused", max_retries=0, timeout=300)
    async with client:
        while time.monotonic() < deadline:
            i = rng.randrange(len(refs))
            cancel = rng.randrange(0, args.max_tokens) if rng.random() < args.cancel else None
            outcome, text = await one(client, refs[i][0], args.max_tokens, cancel)
            record(tally, outcome, text, refs[i][1], time.monotonic(), args.blame_s)
            if outcome.startswith("refused"):
                await asyncio.sleep(1.0)  # what its Retry-After says (the router sends 1 s)


async def storms(args, platform, refs, tally, deadline) -> None:
    client = openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key="unused", max_retries=0, timeout=300)
    async with client:
        while time.monotonic() + args.storm_every < deadline:
            await asyncio.sleep(args.storm_every)
            picks = [refs[k % len(refs)] for k in range(args.storm_size)]
            results = await asyncio.gather(*(one(client, prompt, args.max_tokens, k % 3)
                                             for k, (prompt, _) in enumerate(picks)))
            for (outcome, text), (_, reference) in zip(results, picks, strict=True):
                record(tally, outcome, text, reference, time.monotonic(), args.blame_s)


async def chaos(args, platform, tally, deadline, rng) -> None:
    victims = platform.children(args.victims.split(","))
    while True:
        await asyncio.sleep(args.kill_every * rng.uniform(0.5, 1.5))
        if time.monotonic() > deadline - args.blame_s:
            return
        await asyncio.to_thread(platform.back.wait, 120) if tally.kills else None
        victim = rng.choice(victims)
        tally.kills.append((time.monotonic(), victim))
        platform.kill(victim)


async def scrape_stale(args, platform, tally, deadline) -> None:
    """Stale-stamp counters restart at 0 with their process: keep each life's maximum."""
    workers = args.prefill + args.decode
    while time.monotonic() < deadline + 5:
        for index in range(1, workers + 1):
            try:
                m = await asyncio.to_thread(platform.worker_metrics, index)
            except OSError:
                continue  # restarting
            key = (index, m.get("process_start_time_seconds", 0.0))
            tally.stale[key] = max(tally.stale.get(key, 0.0), m.get("glmserve_kv_transfer_stale_total", 0.0))
        await asyncio.sleep(2)


async def soak(args, platform: Platform, load: MachineLoad) -> tuple[Tally, list[tuple[str, str]]]:
    rng = random.Random(args.seed)
    client = openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key="unused", max_retries=0, timeout=300)
    async with client:
        refs = [(p, (await one(client, p, args.max_tokens, None))[1]) for p in prompts(args.prompts, args.seed)]
    tally, deadline = Tally(), time.monotonic() + 60 * args.minutes
    tasks = [client_loop(args, platform, refs, tally, deadline, random.Random(rng.random())) for _ in range(args.clients)]
    await asyncio.gather(*tasks, storms(args, platform, refs, tally, deadline),
                         chaos(args, platform, tally, deadline, rng), scrape_stale(args, platform, tally, deadline),
                         sample_load(load, deadline))
    return tally, refs


class MachineLoad:
    """The machine's load over the run: load average at start, end and its peak (sampled), and the
    share of all cores busy (from /proc/stat), so a reader knows what else competed."""

    def __init__(self) -> None:
        self.start, self.peak = load_average(), float(load_average())
        self._busy0, self._total0 = _cpu_times()
        self.wall0 = time.monotonic()

    def sample(self) -> None:
        self.peak = max(self.peak, float(load_average()))

    def summary(self) -> str:
        busy, total = _cpu_times()
        share = (busy - self._busy0) / max(1, total - self._total0)
        return (f"{time.monotonic() - self.wall0:.0f} s wall, machine CPU busy {share:.0%} of {os.cpu_count()} "
                f"cores, load average {self.start} at start, peak {self.peak:.1f}, {load_average()} at end")


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


async def sample_load(load: MachineLoad, deadline: float) -> None:
    while time.monotonic() < deadline:
        load.sample()
        await asyncio.sleep(5)


def leaked_blocks(args, platform: Platform) -> list[float]:
    """Every worker's used device blocks once idle (polled until 0 or 30 s)."""
    out = []
    for index in range(1, args.prefill + args.decode + 1):
        deadline = time.monotonic() + 30
        while True:
            used = platform.worker_metrics(index).get("glmserve_kv_blocks_used", -1)
            if used == 0 or time.monotonic() > deadline:
                out.append(used)
                break
            time.sleep(0.5)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=5)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--cancel", type=float, default=0.5, help="share of requests their client cancels")
    p.add_argument("--storm-every", type=float, default=10.0)
    p.add_argument("--storm-size", type=int, default=48)
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--victims", default="decode,prefill,kvstore")
    p.add_argument("--blame-s", type=float, default=10.0, help="a failure this soon after a kill is the kill's")
    p.add_argument("--metrics-base", type=int, default=19300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print_header("Chaos soak", "python bench/bench_chaos_soak.py " + " ".join(sys.argv[1:]))
    load = MachineLoad()
    platform = Platform(args, Path(os.environ.get("TMPDIR", "/tmp")) / "glmserve-chaos-soak.log")
    try:
        tally, _ = asyncio.run(soak(args, platform, load))
        leaked = leaked_blocks(args, platform)
        router = platform.router_metrics()
    finally:
        status = platform.stop()
    migrations = {o: int(router.get(f"glmserve_router_stream_migrations_total{{outcome='{o}'}}", 0))
                  for o in ("resumed", "ended")}
    restarts = sum(platform.restarts.values())
    rows = [
        ("requests completed", tally.completed),
        ("  greedy answer equal to the unloaded run", f"{tally.exact} of {tally.completed}"),
        ("requests cancelled by their client (storms included)", tally.cancelled),
        ("requests refused before any byte with Retry-After (429 / 503)", dict(tally.refused)),
        ("requests failed, ended within the blame window of a kill", tally.failed_on_killed),
        ("requests failed otherwise", tally.failed_other),
        ("kills (SIGKILL)", f"{len(tally.kills)}: {dict(Counter(v.rsplit('-', 1)[0] for _, v in tally.kills))}"),
        ("restarts by the launcher", f"{restarts}: {dict(platform.restarts)}"),
        ("leaked KV blocks (used blocks once idle, per worker)", leaked),
        ("stale-stamp rejections", int(sum(tally.stale.values()))),
        ("streams migrated to another decode worker / ended without one", f"{migrations['resumed']} / "
                                                                         f"{migrations['ended']}"),
        ("launcher exit status on SIGTERM", status),
    ]
    print(markdown_table(["what", "value"], rows))
    for error in Counter(tally.other_errors).most_common(5):
        print(f"- unexplained failure x{error[1]}: {error[0]}")
    print(f"\n- run: {load.summary()}")


if __name__ == "__main__":
    main()
