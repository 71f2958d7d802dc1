"""The fault campaign: one failure at a time beside healthy traffic, and what it did to the rest.

Every fault runs against fresh servers on loopback, beside bystanders: ``--sessions`` greedy chat
sessions (a system prompt of about 150 tokens, replies of ``--max-tokens``, streamed, through the
``openai`` client), each ``--turns`` turns while the fault happens, then one more turn and a fresh
session afterwards (the recovery round). Faults:

- ``forward raises``: requests whose prompt holds a trigger word make the model's forward raise
  (in process: a subclass of the model, keyed on the tokens a step computes);
- ``NaN logits``: requests whose prompt holds another word get NaN logits (an fp16 overflow);
- ``disconnect storm``: ``--storm`` streams dropped after one to three chunks, and as many plain
  requests whose client gives up after 0.3 s;
- ``full pool``: a pool of 24 blocks (384 tokens) for all the sessions at once (they preempt each
  other; nothing is faulty);
- ``replica SIGKILL``: two ``radixcache serve`` replicas on one redis-server behind SGLang's model
  gateway (round robin); replica 1 is killed mid-stream, the sessions go on through the router
  (and others straight to replica 0), then replica 1 restarts on the same port and Redis and
  serves the recovery round through the router and straight;
- ``Redis SIGKILL``: two replicas on one redis-server, sessions straight to each; Redis is killed
  while blocks are being written and restarted (empty) on the same port a few seconds later.

Per fault: bystander requests (during and after), those that failed (target 0: for the replica
fault this counts those on the other replica and those the router sent after the kill), the faulty
requests and how many got an error naming their own cause (in-process faults) or were in flight
on the killed replica, pool blocks still held once every server is idle (target 0), and wrong
tokens: every bystander request of every server's ``--log-token-ids`` file checked against plain
``model.generate`` on its prompt, greedy, in float32 (target 0).

    python benchmarks/faults.py [--model DIR] [--sessions 4] [--turns 3] [--max-tokens 24]
                                [--storm 24] [--faults NAME,...] [--json PATH]

Without ``--model`` a tiny random Llama (with the embedded SmolLM2's tokenizer) is written to a
temporary directory: the campaign is about isolation, not speed. Bounded: each phase sends at most a
few hundred requests, each with a 120 s timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402  (imported here: threads importing it at once can see it half made)
import openai  # noqa: E402

from report import table  # noqa: E402

BOMB_WORD, POISON_WORD = " giraffe", " zebra"
SYSTEM = ("You are a field guide for rivers and lakes. Answer in short sentences, name the sources "
          "you rely on, and say when you are not sure. ") * 4
EXTRA = ("--dtype", "float32", "--served-model-name", "m")  # every replica
FAULTS = ("forward raises", "NaN logits", "disconnect storm", "full pool", "replica SIGKILL", "Redis SIGKILL")


class Outcome(NamedTuple):
    """One fault's row (see the module docstring)."""

    fault: str
    bystanders: int
    failed: int
    faulty: int
    reported: int
    leaked: int
    checked: int
    wrong: int
    note: str


# ---------------------------------------------------------------------------- the model
def tiny_model_dir(path: Path) -> Path:
    """A tiny random float32 Llama (seed 0) with the embedded tokenizer, saved in ``path``."""
    import torch
    import transformers as tf
    from transformers import AutoTokenizer

    from radixcache.models import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    tokenizer.save_pretrained(path)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    tf.GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(path)
    return path


def faulty(model, bomb: int, poison: int):
    """``model`` switched to a subclass of its class whose forward raises on a step that computes
    ``bomb`` and gives NaN logits to every row of a sequence whose new tokens hold ``poison``."""
    import torch

    base = type(model)

    class Faulty(base):
        def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
            if input_ids is not None and (input_ids == bomb).any():
                raise RuntimeError("the model fell over (fault injected)")
            out = base.forward(self, input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
            plan = getattr(kwargs.get("cache"), "step_plan", None)
            if plan is not None and torch.is_tensor(logits_to_keep):
                ids = input_ids[0].tolist()
                for row, at in enumerate(logits_to_keep.tolist()):
                    seg = next(s for s in plan.segments if s.q_start <= at < s.q_start + s.q_len)
                    if poison in ids[seg.q_start:seg.q_start + seg.q_len]:
                        out.logits[0, row] = float("nan")
            return out

    model.__class__ = Faulty
    return model


class Reference:
    """Plain ``model.generate`` (greedy, float32) for the token checks."""

    def __init__(self, model_dir: Path):
        from radixcache.integrations.serve.state import load_model_info
        from radixcache.models import load_model

        self.tokenizer, self.info = load_model_info(model_dir)
        self.model, _ = load_model(model_dir, dtype="float32", device="cpu")

    def token_id(self, word: str) -> int:
        ids = self.tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"{word!r} is not one token of this tokenizer: pick other trigger words")
        return ids[0]

    def wrong(self, log_paths, ids: set) -> tuple[int, int]:
        """``(checked, wrong)``: the requests of ``ids`` in the token logs whose first output is not
        plain greedy ``generate`` on their prompt (a stop token included)."""
        import torch

        from radixcache.integrations.serve.telemetry.token_log import read_token_log

        checked = wrong = 0
        stops = sorted(self.info.stop_token_ids)
        for path in log_paths:
            if not Path(path).exists():
                continue
            for line in read_token_log(path):
                if line["id"] not in ids or line["finish_reasons"][0] not in ("stop", "length"):
                    continue
                out = line["output_ids"][0]
                prompt = torch.tensor([line["prompt_ids"]])
                with torch.no_grad():
                    plain = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                                max_new_tokens=len(out), eos_token_id=stops, pad_token_id=0)
                checked += 1
                wrong += plain[0, prompt.shape[1]:].tolist() != out
        return checked, wrong


# ---------------------------------------------------------------------------- traffic
class Ledger:
    """What the clients saw: the bystanders' request ids, their failures, the faulty requests'."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bystander_ids: set = set()
        self.bystanders = self.failed = self.faulty = self.reported = 0
        self.failures: list = []

    def bystander(self, ok: bool, rid: str | None, why: str = "") -> None:
        with self.lock:
            self.bystanders += 1
            if rid:
                self.bystander_ids.add(rid)
            if not ok:
                self.failed += 1
                self.failures.append(why)

    def fault(self, reported: bool) -> None:
        with self.lock:
            self.faulty += 1
            self.reported += reported


def chat_turn(base_url: str, messages: list, max_tokens: int) -> tuple[str, str]:
    """One streamed greedy chat turn: ``(reply, response id)``; raises on any failure."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    text, rid = "", None
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        rid = rid or chunk.id
        text += "".join(c.delta.content or "" for c in chunk.choices)
    return text, rid


class Session:
    """One bystander conversation; ``turn(url)`` sends its next turn to ``url``."""

    def __init__(self, name: str, max_tokens: int):
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Session {name}: which river is longest?"}]
        self.max_tokens = max_tokens
        self.n = 0

    def turn(self, url: str, ledger: Ledger) -> bool:
        try:
            reply, rid = chat_turn(url, self.messages, self.max_tokens)
        except Exception as exc:  # noqa: BLE001 - counted: a bystander must never fail
            ledger.bystander(False, None, f"{type(exc).__name__}: {exc}"[:200])
            return False
        ledger.bystander(True, rid)
        self.n += 1
        self.messages += [{"role": "assistant", "content": reply},
                          {"role": "user", "content": f"And after that, turn {self.n}?"}]
        return True


def run_sessions(urls, sessions: list, turns: int, ledger: Ledger) -> None:
    """Every session plays ``turns`` turns, session i on ``urls[i % len(urls)]``, concurrently."""
    def play(i, session):
        for _ in range(turns):
            session.turn(urls[i % len(urls)], ledger)

    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(play, range(len(sessions)), sessions))


def faulty_requests(base_url: str, word: str, count: int, cause: str, ledger: Ledger) -> None:
    """``count`` requests (chat, streamed or not) carrying ``word``; each must fail naming ``cause``."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    for i in range(count):
        messages = [{"role": "user", "content": f"Tell me about item {i}{word}."}]
        try:
            out = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                 stream=bool(i % 2))
            if i % 2:
                list(out)
            ledger.fault(False)
        except openai.APIError as exc:
            ledger.fault(cause in str(exc))


def storm(base_url: str, count: int, ledger: Ledger) -> None:
    """``count`` streams dropped after 1-3 chunks and ``count`` plain requests given up after 0.3 s."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Write a long essay about lakes."}],
            "max_tokens": 400, "temperature": 0}
    for i in range(count):
        with httpx.stream("POST", base_url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as response:
            for n, line in enumerate(response.iter_lines()):
                if n >= 1 + i % 3:
                    break
        ledger.fault(True)
        try:
            httpx.post(base_url + "/v1/chat/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            pass
        ledger.fault(True)


# ---------------------------------------------------------------------------- servers
class InProcessServer:
    """``radixcache``'s server over ``model`` in this process (uvicorn on a thread, a free port),
    logging token ids to ``log``."""

    def __init__(self, model, model_dir: Path, log: Path, **options):
        import uvicorn

        import radixcache
        from radixcache.integrations.serve.app import create_app
        from radixcache.integrations.serve.engine.local import LocalEngine
        from radixcache.integrations.serve.options import ServeOptions
        from radixcache.integrations.serve.server import build_state

        from server_process import free_port

        pool = options.pop("max_cache_tokens", 65536)
        self.lm = radixcache.wrap(model, block_size=16, max_cache_tokens=pool)
        self.state = build_state(ServeOptions(model=model_dir, log_token_ids=log, served_model_names=("m",),
                                              **options))
        self.engine = LocalEngine(self.lm, self.lm.new_engine(max_running=self.state.options.max_running))
        self.state.attach_engine(self.engine)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port,
                                                    log_level="error", lifespan="on"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def leaked(self) -> int:
        """Blocks still held by someone once the server is idle (waits up to 60 s for it)."""
        deadline = time.monotonic() + 60
        while (self.state.gate.in_flight or len(self.state.pending_histories) or self.engine.open_requests
               or self.engine.engine.has_work or self.lm.stats()["running"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.lm.manager.check()
        return self.lm.cache.pinned_blocks + len(self.lm.cache.leaks())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.lm.close()


def replica_leaked(url: str) -> int:
    """Pool blocks a replica still holds once idle (``/v1/loads``; waits up to 60 s), or -1 when
    it does not answer."""
    deadline = time.monotonic() + 60
    while True:
        try:
            load = httpx.get(url + "/v1/loads", timeout=5).json()["loads"][0]
        except (httpx.HTTPError, ValueError, KeyError):
            return -1
        busy = load["num_running_reqs"] + load["num_waiting_reqs"]
        if (not busy and not load["num_used_tokens"]) or time.monotonic() > deadline:
            return load["num_used_tokens"] // 16
        time.sleep(0.1)


# ---------------------------------------------------------------------------- the faults
def in_process(name: str, args, ref: Reference, work: Path) -> Outcome:
    import copy

    model = faulty(copy.deepcopy(ref.model), ref.token_id(BOMB_WORD), ref.token_id(POISON_WORD))
    log = work / f"{name.replace(' ', '-')}.jsonl"
    options = {"max_cache_tokens": 24 * 16} if name == "full pool" else {}
    server = InProcessServer(model, args.model_dir, log, **options)
    ledger = Ledger()
    sessions = [Session(f"{name}-{i}", args.max_tokens) for i in range(args.sessions)]
    note = ""
    try:
        with ThreadPoolExecutor(2) as pool:
            bystanders = pool.submit(run_sessions, [server.base_url], sessions, args.turns, ledger)
            if name == "forward raises":
                pool.submit(faulty_requests, server.base_url, BOMB_WORD, 8, "fell over", ledger).result()
            elif name == "NaN logits":
                pool.submit(faulty_requests, server.base_url, POISON_WORD, 8, "NaN", ledger).result()
            elif name == "disconnect storm":
                pool.submit(storm, server.base_url, args.storm, ledger).result()
            bystanders.result()
        run_sessions([server.base_url], sessions + [Session(f"{name}-fresh", args.max_tokens)], 1, ledger)
        leaked = server.leaked()
        if name == "full pool":
            note = f"{server.lm.stats()['preemptions']} preemptions"
    finally:
        server.stop()
    checked, wrong = ref.wrong([log], ledger.bystander_ids)
    return Outcome(name, ledger.bystanders, ledger.failed, ledger.faulty, ledger.reported, leaked, checked, wrong,
                   note or "; ".join(ledger.failures[:2]))


def replica_sigkill(args, ref: Reference, work: Path) -> Outcome:
    from smg_cluster import Router, replica_command

    from radixcache.integrations.redis_store.local import LocalRedis
    from server_process import ServerProcess, free_port

    ledger = Ledger()
    logs = [work / "replica-0.jsonl", work / "replica-1.jsonl"]
    ports = [free_port(), free_port()]
    redis = LocalRedis(work / "redis-a").start()

    def replica(i):
        return ServerProcess(f"replica-{i}", replica_command(args.model_dir, ports[i], store=redis.url, token_log=logs[i],
                                                             extra=EXTRA), work, 300)

    replicas = [replica(0), replica(1)]
    router = None
    note = ""
    try:
        router = Router([r.base for r in replicas], "round_robin", work / "smg.log")
        # long replies, so that the streams on replica 1 are running when it dies
        routed = [Session(f"routed-{i}", 1500) for i in range(args.sessions)]
        direct = [Session(f"direct-{i}", args.max_tokens) for i in range(2)]
        routed_ledger = Ledger()
        with ThreadPoolExecutor(2) as pool:
            through = pool.submit(run_sessions, [router.base_url], routed, 1, routed_ledger)
            beside = pool.submit(run_sessions, [replicas[0].base], direct, args.turns, ledger)
            time.sleep(1.0)
            replicas[1].proc.kill()
            replicas[1].proc.wait(30)
            through.result()
            beside.result()
        for session in routed:
            session.max_tokens = args.max_tokens
        ledger.faulty, ledger.reported = routed_ledger.failed, routed_ledger.failed  # in flight on replica 1
        ledger.bystanders += routed_ledger.bystanders - routed_ledger.failed
        ledger.bystander_ids |= routed_ledger.bystander_ids
        run_sessions([router.base_url], routed, args.turns, ledger)  # after the kill: the router fails over
        replicas[1] = replica(1)  # restarted on the same port and Redis
        deadline = time.monotonic() + 60
        while router.get("/readiness").json().get("healthy_workers") != 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        fresh = [Session(f"fresh-{i}", args.max_tokens) for i in range(2)]
        run_sessions([router.base_url], routed + direct + fresh, 1, ledger)
        run_sessions([replicas[1].base], [Session("after-restart", args.max_tokens)], 2, ledger)
        leaked = sum(max(replica_leaked(r.base), 0) for r in replicas)
        note = "killed mid-stream; restarted on the same Redis"
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
        redis.stop()
    checked, wrong = ref.wrong(logs, ledger.bystander_ids)
    return Outcome("replica SIGKILL", ledger.bystanders, ledger.failed, ledger.faulty, ledger.reported, leaked,
                   checked, wrong, note if not ledger.failures else "; ".join(ledger.failures[:2]))


def redis_sigkill(args, ref: Reference, work: Path) -> Outcome:
    from smg_cluster import replica_command

    from radixcache.integrations.redis_store.local import LocalRedis
    from server_process import ServerProcess, free_port

    ledger = Ledger()
    logs = [work / "store-0.jsonl", work / "store-1.jsonl"]
    redis = LocalRedis(work / "redis-b").start()
    replicas = [ServerProcess(f"store-{i}", replica_command(args.model_dir, free_port(), store=redis.url,
                                                            token_log=logs[i], extra=EXTRA),
                              work, 300) for i in range(2)]

    def written() -> int:
        total = 0
        for r in replicas:
            for line in httpx.get(r.base + "/metrics", timeout=10).text.splitlines():
                if line.startswith("radixcache:store_written_blocks_total"):
                    total += float(line.split()[-1])
        return int(total)

    try:
        sessions = [Session(f"store-{i}", args.max_tokens) for i in range(args.sessions)]
        urls = [r.base for r in replicas]
        with ThreadPoolExecutor(2) as pool:
            traffic = pool.submit(run_sessions, urls, sessions, args.turns, ledger)
            time.sleep(1.0)  # blocks are being written
            redis.kill()
            time.sleep(3.0)  # requests go on without the store
            redis.start()
            traffic.result()
        before = written()
        run_sessions(urls, sessions + [Session(f"store-fresh-{i}", args.max_tokens) for i in range(2)], 1, ledger)
        deadline = time.monotonic() + 30
        while written() <= before and time.monotonic() < deadline:
            time.sleep(0.5)
        resumed = written() > before
        leaked = sum(max(replica_leaked(u), 0) for u in urls)
    finally:
        for r in replicas:
            r.stop()
        redis.stop()
    checked, wrong = ref.wrong(logs, ledger.bystander_ids)
    note = "writes resumed after the restart" if resumed else "writes did NOT resume"
    return Outcome("Redis SIGKILL", ledger.bystanders, ledger.failed, 0, 0, leaked, checked, wrong,
                   note if not ledger.failures else "; ".join(ledger.failures[:2]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: a tiny random Llama)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--storm", type=int, default=24, help="streams dropped in the disconnect storm")
    parser.add_argument("--faults", default=",".join(FAULTS), help="which faults, comma-separated")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="radixcache-faults-") as tmp:
        work = Path(tmp)
        args.model_dir = Path(args.model) if args.model else tiny_model_dir(work / "tiny-model")
        ref = Reference(args.model_dir)
        rows = []
        for name in chosen:
            began = time.monotonic()
            if name == "replica SIGKILL":
                row = replica_sigkill(args, ref, work)
            elif name == "Redis SIGKILL":
                row = redis_sigkill(args, ref, work)
            else:
                row = in_process(name, args, ref, work)
            rows.append(row)
            print(f"{name}: done in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    print(table(["fault", "bystander requests", "failed", "faulty requests", "reported / in flight",
                 "blocks leaked", "checked", "wrong tokens", "note"],
                [[str(c) for c in r] for r in rows], left=(0, 8)))
    if args.json:
        Path(args.json).write_text(json.dumps([r._asdict() for r in rows], indent=1))
    bad = [r.fault for r in rows if r.failed or r.leaked or r.wrong]
    if bad:
        print(f"targets missed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
