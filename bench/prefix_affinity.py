"""Prefix affinity against least-wait routing on two real Tritons in one cell (issue 32).

What it measures
    Two Tritons, each serving ``chat-v1`` (the capacity emulator with a prefix cache per server:
    16-token blocks, 4,096 of them; 2 instances = 2 emulated devices each), behind one gateway
    with both as backends of the privacy cell ``eu-restricted``. The same multi-turn chat
    workload (same seed) runs against two targets, each on *fresh* Tritons (a ``LocalTriton``
    start empties its prefix cache) and a fresh ``orchid-gateway serve`` process:

    * ``affinity``: the routes as shipped (``chat``: ``prefix_affinity: {max_extra_wait_ms: 20}``);
    * ``least-wait``: a copy of the routes with ``prefix_affinity`` removed from ``chat``, every
      other setting identical (the least-loaded backend by predicted wait);
    * ``affinity-2-replicas``: ``affinity``'s routes on two ``orchid-gateway serve`` replicas of
      one fleet (``state: {backend: redis}`` on a ``redis-server`` the bench starts on a free
      port, one ``key_prefix`` per target), each request sent to the replicas in turn
      (round-robin per request in send order, as an L4 balancer without session stickiness
      would), so a conversation's next turn reaches the other replica about one time in two.
      Each replica keeps its own prefix index (docs/prefix-affinity.md section 5): this
      measures what that costs against one replica;
    * ``affinity-2-replicas-sticky``: the same fleet, each conversation pinned to one replica
      by a hash of its id.

    Reported per target: requests, answers, refusals by status and rule, answers on time (OK
    within the deadline, which is the client's gRPC deadline), p50/p95 latency of answers; from
    each answer's ``PREFIX_CACHED_TOKENS``: the hit rate (answers with a cached token), the
    share of answered prompt tokens served from cache, and the share of later turns that found
    their whole conversation so far; cross-tenant hits (an answer reporting more cached tokens
    than its own tenant's earlier prompts, on any backend, could explain; orchid and lumen send
    the *same* system prompt, so their first turns are the sharpest check); from Triton's own
    statistics: device-ms (``compute_input + compute_infer + compute_output``) over both servers
    per answered request, each backend's share of executions and requests and its mean queue
    time; the emulator's cache statistics per backend (lookups, hits, evictions; SQLite); the
    gateway's ``/metrics`` (``orchid_prefix_*``: spills, largest predicted extra wait, which must
    stay within the route's bound; with two replicas the counters summed over both, the
    largest extra wait the larger of the two). Then the ratios affinity / least-wait and
    each replica target / affinity, whether the issue's targets held, and the replicas' cost.

Workload (``--seed``; identical for both targets)
    Tenants orchid, lumen and wren (a tenants copy lets lumen call ``chat`` and adds wren), each
    with a ``--system-tokens`` (512) system prompt; orchid and lumen share one. Conversations
    start as a Poisson process per tenant over ``--seconds``; each has 3-8 turns; turn k's prompt
    is the system prompt, every earlier user message and the answer actually returned
    (``OUTPUT_IDS``; a refused turn's answer is a fixed stand-in drawn with the workload, so the
    prompts stay identical across targets), then the new user message (32-128 tokens);
    ``orchid.max_output_tokens`` 32-64; a think time of 0.5-2 s between an answer and the next
    turn. The conversation rate is sized so that the work, priced as least-wait would find it
    (the tenant's system prompt cached, half of the conversation before it), is ``--load``
    (0.65) of the 4 devices' time. Deadline: the interactive class's ``default_deadline_ms``
    (200 ms) x the time factor, unless ``--deadline-ms``.

Scaling
    ``--time-factor`` f (default 1.0: the seed's own time; a 1,000-token uncached prompt's
    prefill is 100 ms, long against this machine's scheduling noise): the emulator sleeps x f,
    the gateway's backends declare ``time_scale: f`` and its classes' ``*_ms`` constants are
    x f (``orchid_tools.harness.scaled_classes``). Tenant quotas are not scaled.

How
    ``python bench/prefix_affinity.py`` (~5 min on 2 cores; ``--targets affinity,least-wait``
    ~2.5 min). Exit status 1 only for a broken
    run (a target with no answers, a Triton or gateway that did not start), never for a missed
    target.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.grpc import service_pb2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.backends.local import LocalTriton, TritonStartError, free_port  # noqa: E402
from gateway.core.prefix import block_keys, cached_tokens  # noqa: E402
from orchid_tools.fleet_demo import start_redis  # noqa: E402
from orchid_tools.harness import (  # noqa: E402
    EXAMPLES,
    GatewayProcess,
    example_backend,
    example_config,
    example_settings,
    scaled_classes,
)

INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_REPOSITORY = EXAMPLES / "model_repository"
ROUTES = ROOT / "routes" / "orchid.yaml"
ROUTE = "chat"
MODEL = "chat-v1"
CELL = "eu-restricted"
VOCAB = 32_000
WREN_KEY = "orchid-bench-key-wren"
KEYS = {"orchid": "orchid-demo-key-orchid", "lumen": "orchid-demo-key-lumen", "wren": WREN_KEY}
SHARED_PROMPT = ("orchid", "lumen")  # these two send the same system prompt
DEVICES_PER_BACKEND = 2  # chat-v1's instance count
TARGETS = ("affinity", "least-wait", "affinity-2-replicas", "affinity-2-replicas-sticky")
REPLICAS = {"affinity-2-replicas": (2, "round-robin"), "affinity-2-replicas-sticky": (2, "sticky")}
SHORT = {  # column headings
    "affinity": "affinity",
    "least-wait": "least-wait",
    "affinity-2-replicas": "2 replicas rr",
    "affinity-2-replicas-sticky": "2 repl. sticky",
}
Tokens = npt.NDArray[np.int32]


# --- the workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    user: Tokens  # the new user message's tokens
    max_output: int
    think_s: float  # after the previous answer (turn 0: 0)
    stand_in: Tokens  # the answer appended if this turn is not answered


@dataclass(frozen=True)
class Conversation:
    ident: int
    tenant: str
    start_s: float
    turns: tuple[Turn, ...]


def profile() -> dict[str, float]:
    """chat's cost profile (routes/orchid.yaml), the emulator's chat-v1 costs."""
    routes = yaml.safe_load(ROUTES.read_text())
    prof: dict[str, float] = routes["profiles"][routes["models"][ROUTE]["profile"]]
    return prof


def bound_ms() -> float:
    routes = yaml.safe_load(ROUTES.read_text())
    return float(routes["models"][ROUTE]["prefix_affinity"]["max_extra_wait_ms"])


def make_conversation(
    rng: np.random.Generator, ident: int, tenant: str, start_s: float, args: argparse.Namespace
) -> Conversation:
    n = int(rng.integers(args.turns[0], args.turns[1] + 1))
    turns = []
    for k in range(n):
        user = rng.integers(0, VOCAB, size=int(rng.integers(args.user_tokens[0], args.user_tokens[1] + 1)))
        out = int(rng.integers(args.output_tokens[0], args.output_tokens[1] + 1))
        think = 0.0 if k == 0 else float(rng.uniform(args.think_s[0], args.think_s[1]))
        stand_in = rng.integers(0, VOCAB, size=out)
        turns.append(Turn(user.astype(np.int32), out, think, stand_in.astype(np.int32)))
    return Conversation(ident, tenant, start_s, tuple(turns))


def least_wait_device_ms(conversation: Conversation, system: int, prof: dict[str, float]) -> float:
    """The conversation's device-ms (time factor 1) as least-wait routing would find its cache:
    the tenant's system prompt cached on either backend, half of the conversation before it."""
    total = 0.0
    length = system
    previous = system
    for turn in conversation.turns:
        prompt = length + len(turn.user)
        cached = system + 0.5 * (previous - system)
        total += (
            prof["fixed_ms"]
            + prof["prefill_ms_per_token"] * (prompt - cached)
            + prof["decode_ms_per_token"] * turn.max_output
        )
        previous = prompt
        length = prompt + turn.max_output
    return total


def workload(args: argparse.Namespace) -> tuple[dict[str, Tokens], list[Conversation], float]:
    """The system prompts, the conversations in start order, and the conversation rate (per s)."""
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, VOCAB, size=args.system_tokens).astype(np.int32)
    systems = {tenant: shared for tenant in SHARED_PROMPT}
    systems["wren"] = rng.integers(0, VOCAB, size=args.system_tokens).astype(np.int32)
    # Size the rate on a sample of conversations drawn like the real ones.
    sample_rng = np.random.default_rng(args.seed + 1)
    prof = profile()
    sample = [make_conversation(sample_rng, -1, "x", 0.0, args) for _ in range(400)]
    mean_ms = statistics.fmean(least_wait_device_ms(c, args.system_tokens, prof) for c in sample)
    devices = 2 * DEVICES_PER_BACKEND
    rate = args.load * devices * 1000.0 / (mean_ms * args.time_factor)  # conversations per s
    conversations: list[Conversation] = []
    per_tenant = rate / len(systems)
    for tenant in sorted(systems):
        t = float(rng.exponential(1.0 / per_tenant))
        while t < args.seconds:
            conversations.append(make_conversation(rng, 0, tenant, t, args))
            t += float(rng.exponential(1.0 / per_tenant))
    conversations.sort(key=lambda c: c.start_s)
    conversations = [Conversation(i, c.tenant, c.start_s, c.turns) for i, c in enumerate(conversations)]
    return systems, conversations, rate


# --- one run -------------------------------------------------------------------------------


@dataclass
class Answer:
    tenant: str
    conversation: int
    turn: int
    prompt: Tokens
    sent: float  # loop time
    ended: float
    outcome: str  # "OK" or "<status> <rule>"
    cached: int = 0
    replica: int = 0  # the gateway replica it was sent to


@dataclass
class Backend:
    name: str
    executions: int = 0
    requests: int = 0
    queue_ms: float = 0.0  # summed over its requests
    device_ms: float = 0.0
    cache: dict[str, int] = field(default_factory=dict)  # the emulator's stats over the run


@dataclass
class Run:
    label: str
    answers: list[Answer] = field(default_factory=list)
    backends: list[Backend] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    replicas: int = 1  # gateway replicas of one fleet
    steady_busy: float = float("nan")  # devices' busy share once conversations overlap, to the last start

    @property
    def requests(self) -> int:
        return len(self.answers)

    @property
    def answered(self) -> list[Answer]:
        return [a for a in self.answers if a.outcome == "OK"]

    @property
    def device_ms(self) -> float:
        return sum(b.device_ms for b in self.backends)


def request_bytes(prompt: Tokens, max_output: int) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=ROUTE)
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, len(prompt)])
    request.raw_input_contents.append(prompt.astype("<i4").tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = max_output
    body: bytes = request.SerializeToString()
    return body


def outputs(body: bytes) -> tuple[Tokens, int]:
    """An answer's OUTPUT_IDS and PREFIX_CACHED_TOKENS."""
    response = service_pb2.ModelInferResponse.FromString(body)
    tokens = np.zeros(0, dtype=np.int32)
    cached = -1
    for i, output in enumerate(response.outputs):
        raw = response.raw_output_contents[i]
        if output.name == "OUTPUT_IDS":
            tokens = np.frombuffer(raw, dtype="<i4").astype(np.int32)
        elif output.name == "PREFIX_CACHED_TOKENS":
            cached = int(np.frombuffer(raw, dtype="<i4")[0])
    if cached < 0:
        raise RuntimeError("an answer without PREFIX_CACHED_TOKENS")
    return tokens, cached


def pinned(conversation: Conversation, replicas: int) -> int:
    """The replica a sticky balancer pins ``conversation`` to: a hash of its id."""
    digest = hashlib.sha256(f"conversation-{conversation.ident}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % replicas


async def drive(
    addresses: tuple[str, ...],
    systems: dict[str, Tokens],
    conversations: list[Conversation],
    deadline_s: float,
    run: Run,
    steady: tuple[float, float] = (0.0, 0.0),
    tritons: tuple[str, ...] = (),
    balance: str = "round-robin",
) -> None:
    """Every conversation, each turn after the previous answer and its think time, to the
    gateway replicas at ``addresses`` (``balance``: ``round-robin``, each request to the next
    replica in send order; ``sticky``, each conversation to the replica ``pinned`` picks); and
    the devices' busy share between ``steady``'s times (s after the start; Triton's statistics)."""
    channels = [
        grpc.aio.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", 1 << 24), ("grpc.max_receive_message_length", 1 << 24)],
        )
        for address in addresses
    ]
    calls = [channel.unary_unary(INFER) for channel in channels]
    sent_count = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.2

    def replica_for(conversation: Conversation) -> int:
        nonlocal sent_count
        if balance == "sticky":
            return pinned(conversation, len(calls))
        sent_count += 1
        return (sent_count - 1) % len(calls)

    async def converse(conversation: Conversation) -> None:
        await asyncio.sleep(max(0.0, t0 + conversation.start_s - loop.time()))  # its start
        history = systems[conversation.tenant]
        metadata = (("authorization", f"Bearer {KEYS[conversation.tenant]}"),)
        for k, turn in enumerate(conversation.turns):
            if turn.think_s:
                await asyncio.sleep(turn.think_s)  # the user thinks (the workload, not a wait)
            prompt = np.concatenate([history, turn.user])
            sent = loop.time()
            replica = replica_for(conversation)
            answer = Answer(conversation.tenant, conversation.ident, k, prompt, sent, sent, "OK", 0, replica)
            reply = turn.stand_in
            try:
                body = await calls[replica](
                    request_bytes(prompt, turn.max_output), metadata=metadata, timeout=deadline_s
                )
                reply, answer.cached = outputs(body)
            except grpc.aio.AioRpcError as error:
                rule = dict(error.trailing_metadata() or ()).get("orchid-rule", "")
                answer.outcome = f"{error.code().name} {rule}".strip()
            answer.ended = loop.time()
            run.answers.append(answer)
            history = np.concatenate([prompt, reply])

    async def sample() -> None:
        if not tritons or steady[1] <= steady[0]:
            return
        device_ms = []
        for at in steady:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))  # the window's edge (a schedule)
            stats = await asyncio.gather(*(asyncio.to_thread(triton_stats, a) for a in tritons))
            device_ms.append(sum(s[3] for s in stats))
        devices = DEVICES_PER_BACKEND * len(tritons)
        run.steady_busy = (device_ms[1] - device_ms[0]) / (devices * (steady[1] - steady[0]) * 1000.0)

    started = time.monotonic()
    try:
        await asyncio.gather(*(converse(c) for c in conversations), sample())
    finally:
        for channel in channels:
            await channel.close()
    run.wall_s = time.monotonic() - started


def repository(into: Path) -> Path:
    """A repository with chat-v1 alone, beside the emulator (as tests/test_prefix_triton.py)."""
    repo = into / "model_repository"
    shutil.copytree(MODEL_REPOSITORY / MODEL, repo / MODEL)
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", into / "emulator")
    return repo


def triton_stats(address: str) -> tuple[int, int, float, float]:
    """chat-v1's executions, requests, queue ms and compute ms so far (Triton's statistics)."""
    client = grpcclient.InferenceServerClient(address)
    try:
        stats = client.get_inference_statistics(model_name=MODEL).model_stats[0]
    finally:
        client.close()
    inference = stats.inference_stats
    compute = inference.compute_input.ns + inference.compute_infer.ns + inference.compute_output.ns
    return int(stats.execution_count), int(inference.success.count), inference.queue.ns / 1e6, compute / 1e6


def cache_stats(server: LocalTriton) -> dict[str, int]:
    """The emulator's prefix-cache statistics of chat-v1 on ``server`` (its SQLite file)."""
    path = server.workdir / "prefix-cache" / f"{MODEL}.prefix.sqlite"
    if not path.exists():
        return {}
    with sqlite3.connect(path) as db:
        return {name: int(value) for name, value in db.execute("SELECT name, value FROM stats")}


def warm(server: LocalTriton) -> None:
    """Two rounds of one request per instance straight at Triton (an instance's first execute is
    slow), in a scope of its own: no tenant's entry."""
    client = grpcclient.InferenceServerClient(server.address)

    def one(_: int) -> None:
        tensor = grpcclient.InferInput("INPUT_IDS", [1, 64], "INT32")
        tensor.set_data_from_numpy(np.arange(64, dtype=np.int32).reshape(1, -1))
        client.infer(MODEL, [tensor], parameters={"prefix_scope": "bench-warm-up", "max_output_tokens": 4})

    try:
        with ThreadPoolExecutor(max_workers=DEVICES_PER_BACKEND) as pool:
            for _ in range(2):
                list(pool.map(one, range(DEVICES_PER_BACKEND)))
    finally:
        client.close()


def start_triton(work: Path, name: str, f: float, attempts: int = 3) -> LocalTriton:
    """A fresh Triton on a chat-v1 repository; a failed start is retried (the emulator's
    instances open the server's SQLite cache at once, and on a loaded machine a load can fail;
    the log says so)."""
    repo = repository(work / f"repo-{name}")
    for attempt in range(1, attempts + 1):
        server = LocalTriton(repo, work / f"triton-{name}-{attempt}", time_factor=f)
        try:
            server.start()
            return server
        except TritonStartError as error:
            server.stop()
            log = server.log_path.read_text(errors="replace") if server.log_path.exists() else str(error)
            found = re.search(r"(\w+Error: [^\\\n\"]*).*?(\w+\.py\(\d+\))", log, re.DOTALL)
            why = f"{found.group(1)} at {found.group(2)}" if found else str(error).splitlines()[-1]
            print(f"triton-{name}: start {attempt} of {attempts} failed ({why})", flush=True)
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def tenants_file(into: Path) -> Path:
    """The example tenants, lumen allowed ``chat`` and a third chat tenant, wren (lumen's terms)."""
    tenants = yaml.safe_load((EXAMPLES / "tenants.yaml").read_text())
    tenants["tenants"]["lumen"]["models"] = [*tenants["tenants"]["lumen"]["models"], ROUTE]
    wren = dict(tenants["tenants"]["lumen"])
    wren["key_sha256"] = [hashlib.sha256(WREN_KEY.encode()).hexdigest()]
    tenants["tenants"]["wren"] = wren
    tenants["quotas"]["tenants"]["wren"] = dict(tenants["quotas"]["tenants"]["lumen"])
    path = into / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants))
    return path


def routes_dir(into: Path, affinity: bool) -> Path:
    """The shipped routes, or a copy with ``prefix_affinity`` removed from ``chat``."""
    if affinity:
        return ROOT / "routes"
    text = ROUTES.read_text()
    text, count = re.subn(r"\n    prefix_affinity: \{max_extra_wait_ms: [0-9.]+\}", "", text)
    if count != 1:
        raise RuntimeError(f"{ROUTES}: expected one prefix_affinity line in {ROUTE}")
    routes = yaml.safe_load(text)
    if "prefix_affinity" in routes["models"][ROUTE]:
        raise RuntimeError("prefix_affinity still set")
    into.mkdir(parents=True, exist_ok=True)
    (into / "orchid.yaml").write_text(text)
    return into


def scrape(metrics_listen: str) -> dict[str, float]:
    """The gateway's orchid_prefix_* samples for the chat route."""
    with urllib.request.urlopen(f"http://{metrics_listen}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"(orchid_prefix_\w+)\{([^}]*)\} (\S+)", line)
        if match and f'model="{ROUTE}"' in match.group(2):
            found[match.group(1)] = float(match.group(3))
    return found


def fleet_metrics(replicas: list[dict[str, float]]) -> dict[str, float]:
    """The replicas' samples as one gateway's: counters summed, ``*_max`` the largest."""
    combined: dict[str, float] = {}
    for metrics in replicas:
        for name, value in metrics.items():
            if name.endswith("_max"):
                combined[name] = max(combined.get(name, value), value)
            else:
                combined[name] = combined.get(name, 0.0) + value
    return combined


def one_run(
    label: str,
    args: argparse.Namespace,
    systems: dict[str, Tokens],
    conversations: list[Conversation],
    deadline_s: float,
    workdir: Path,
) -> Run:
    run = Run(label)
    work = workdir / label
    f = args.time_factor
    servers: list[LocalTriton] = []
    stop: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("a", "b"):
            server = start_triton(work, name, f)
            servers.append(server)
            warm(server)
        before = [(triton_stats(s.address), cache_stats(s)) for s in servers]
        backends = [
            example_backend(
                f"chat-{name}",
                server.address,
                f,
                labels={"cell": CELL, "device_group": f"chat-{name}"},
                devices=DEVICES_PER_BACKEND,
            )
            for name, server in zip(("a", "b"), servers, strict=True)
        ]
        count, balance = REPLICAS.get(label, (1, "round-robin"))
        state: dict[str, object] = {}
        if count > 1:  # one fleet: the replicas share quotas, slots and load through Redis
            redis, url = start_redis(work)
            stop.append(redis)
            state = {"state": {"backend": "redis", "url": url, "key_prefix": f"bench-{label}:"}}
        tenants = str(tenants_file(work))
        routes = str(routes_dir(work / "routes", label != "least-wait"))
        gateways: list[GatewayProcess] = []
        listens: list[str] = []
        try:
            for r in range(count):
                metrics_listen = f"127.0.0.1:{free_port()}"
                config = example_config(
                    backends,
                    without=("jobs",),
                    classes=scaled_classes(f),
                    tenants_file=tenants,
                    routes_dir=routes,
                    telemetry={**example_settings().get("telemetry", {}), "metrics_listen": metrics_listen},
                    limits={**example_settings().get("limits", {}), "drain_timeout_s": 2},
                    **state,
                )
                # Its own directory per replica (each writes its config and log there).
                gateway = GatewayProcess(config, work / f"gateway-{r}" if count > 1 else work, name="gateway")
                gateways.append(gateway)
                gateway.start()
                listens.append(metrics_listen)
            steady = (min(args.ramp_s, args.seconds / 2), args.seconds)
            addresses = tuple(s.address for s in servers)
            run.replicas = count
            asyncio.run(
                drive(
                    tuple(g.listen for g in gateways),
                    systems,
                    conversations,
                    deadline_s,
                    run,
                    steady,
                    addresses,
                    balance,
                )
            )
            time.sleep(0.3)  # the last answers' statistics settle
            run.metrics = fleet_metrics([scrape(listen) for listen in listens])
        finally:
            for gateway in gateways:
                gateway.stop()
        for name, server, ((e0, r0, q0, d0), c0) in zip(("a", "b"), servers, before, strict=True):
            e1, r1, q1, d1 = triton_stats(server.address)
            c1 = cache_stats(server)
            cache = {key: c1.get(key, 0) - c0.get(key, 0) for key in ("lookups", "hits", "evictions")}
            cache["held"] = c1.get("inserted", 0) - c1.get("evictions", 0)
            run.backends.append(Backend(f"chat-{name}", e1 - e0, r1 - r0, q1 - q0, d1 - d0, cache))
    finally:
        for server in servers:
            server.stop()
        for process in stop:  # the fleet's Redis
            process.terminate()
            process.wait(timeout=10)
    return run


# --- analysis ------------------------------------------------------------------------------


@dataclass
class Figures:
    requests: int
    answered: int
    on_time: float  # share of requests
    p50_ms: float
    p95_ms: float
    hit_rate: float  # share of answers with a cached token
    cached_share: float  # share of answered prompt tokens served from cache
    whole_conversation: float  # share of answered later turns that found their whole conversation
    device_ms_per_answer: float
    cross_tenant: int
    first_turns: dict[str, int]  # each tenant's first turn of its first conversation: cached tokens
    outcomes: Counter[str]


def explainable(run: Run, block_tokens: int) -> list[int]:
    """Per answer (run order): the most cached tokens its own tenant's other prompts, sent before
    it was answered to either backend, could explain (a lookup after them, unscoped by backend)."""
    first_senders: dict[tuple[str, bytes], list[tuple[float, int]]] = {}
    keys = [block_keys(a.tenant, a.prompt.astype("<i4").tobytes(), block_tokens) for a in run.answers]
    for i, (answer, chain) in enumerate(zip(run.answers, keys, strict=True)):
        for key in chain:
            senders = first_senders.setdefault((answer.tenant, key), [])
            senders.append((answer.sent, i))
            senders.sort()
            del senders[2:]  # the two earliest suffice: one of them is another request
    limits = []
    for i, (answer, chain) in enumerate(zip(run.answers, keys, strict=True)):
        matched = 0
        for key in chain:
            senders = first_senders[(answer.tenant, key)]
            if not any(j != i and t < answer.ended for t, j in senders):
                break
            matched += 1
        limits.append(cached_tokens(matched, block_tokens, len(answer.prompt)))
    return limits


def figures(run: Run, block_tokens: int) -> Figures:
    answered = run.answered
    latencies = [(a.ended - a.sent) * 1000.0 for a in answered]
    limits = explainable(run, block_tokens)
    cross = sum(1 for a, limit in zip(run.answers, limits, strict=True) if a.cached > limit)
    # Later turns: did they find the whole previous prompt (every full block of it)?
    previous: dict[tuple[int, int], int] = {(a.conversation, a.turn): len(a.prompt) for a in run.answers}
    later = [a for a in answered if a.turn > 0]
    whole = sum(
        1
        for a in later
        if a.cached
        >= cached_tokens(previous[(a.conversation, a.turn - 1)] // block_tokens, block_tokens, len(a.prompt))
    )
    first_turns: dict[str, int] = {}
    for a in sorted(run.answers, key=lambda a: (a.conversation, a.turn)):
        if a.turn == 0 and a.tenant not in first_turns:
            first_turns[a.tenant] = a.cached if a.outcome == "OK" else -1
    prompt_tokens = sum(len(a.prompt) for a in answered)
    return Figures(
        requests=run.requests,
        answered=len(answered),
        on_time=len(answered) / run.requests if run.requests else 0.0,
        p50_ms=float(np.percentile(latencies, 50)) if latencies else float("nan"),
        p95_ms=float(np.percentile(latencies, 95)) if latencies else float("nan"),
        hit_rate=sum(1 for a in answered if a.cached > 0) / len(answered) if answered else 0.0,
        cached_share=sum(a.cached for a in answered) / prompt_tokens if prompt_tokens else 0.0,
        whole_conversation=whole / len(later) if later else 0.0,
        device_ms_per_answer=run.device_ms / len(answered) if answered else float("nan"),
        cross_tenant=cross,
        first_turns=first_turns,
        outcomes=Counter(a.outcome for a in run.answers),
    )


def ratio(a: float, b: float) -> str:
    return f"x{a / b:.3f}" if b else "-"


RATIOS = (  # (numerator, denominator, heading) where both ran
    ("affinity", "least-wait", "aff/lw"),
    ("affinity-2-replicas", "affinity", "rr/aff"),
    ("affinity-2-replicas-sticky", "affinity", "sticky/aff"),
)


def switched(run: Run) -> tuple[float, float, float]:
    """Of the answered later turns: the share sent to another replica than the turn before,
    and the share finding their whole conversation on the same replica and on another."""
    block_tokens = 16
    by_turn = {(a.conversation, a.turn): a for a in run.answers}
    same: list[bool] = []
    other: list[bool] = []
    for a in run.answered:
        if a.turn == 0:
            continue
        before = by_turn[(a.conversation, a.turn - 1)]
        whole = a.cached >= cached_tokens(len(before.prompt) // block_tokens, block_tokens, len(a.prompt))
        (other if before.replica != a.replica else same).append(whole)
    later = len(same) + len(other)
    share = len(other) / later if later else 0.0
    return (
        share,
        sum(same) / len(same) if same else float("nan"),
        sum(other) / len(other) if other else float("nan"),
    )


def report(runs: list[Run], args: argparse.Namespace, deadline_ms: float, rate: float) -> bool:
    block_tokens = 16
    figs = [figures(r, block_tokens) for r in runs]
    by_label = {r.label: i for i, r in enumerate(runs)}
    pairs = [(by_label[n], by_label[d], h) for n, d, h in RATIOS if n in by_label and d in by_label]
    bound = bound_ms()
    print(
        f"\nprefix affinity vs least-wait: chat-v1 on 2 Tritons x {DEVICES_PER_BACKEND} devices, time factor "
        f"{args.time_factor:g}; {len(KEYS)} tenants ({' and '.join(SHARED_PROMPT)} share a system prompt), "
        f"{rate * 60:.1f} conversations/min for {args.seconds:g} s (load {args.load:.0%} priced as "
        f"least-wait), deadline {deadline_ms:g} ms, seed {args.seed}"
    )
    for r in runs:
        if r.replicas > 1:
            how = "round-robin per request" if REPLICAS[r.label][1] == "round-robin" else "per conversation"
            print(
                f"  {SHORT[r.label]}: {r.label}, {r.replicas} gateway replicas on one Redis, {how};"
                " its gateway rows sum the replicas' /metrics (max extra wait: the larger)"
            )
    print()
    width = 16
    print(
        f"{'':44}"
        + "".join(f"{SHORT[r.label]:>{width}}" for r in runs)
        + "".join(f"{h:>{width}}" for _, _, h in pairs)
    )

    def row(name: str, cells: list[str], values: list[float] | None = None) -> None:
        ratios = [ratio(values[n], values[d]) if values else "" for n, d, _ in pairs]
        print(
            f"{name:44}" + "".join(f"{c:>{width}}" for c in cells) + "".join(f"{x:>{width}}" for x in ratios)
        )

    row("requests", [f"{x.requests}" for x in figs])
    row("answered", [f"{x.answered}" for x in figs])
    row("refused / failed", [f"{x.requests - x.answered}" for x in figs])
    row(
        "on time (answered within the deadline)",
        [f"{x.on_time:.2%}" for x in figs],
        [x.on_time for x in figs],
    )
    row("latency p50, ms", [f"{x.p50_ms:.1f}" for x in figs], [x.p50_ms for x in figs])
    row("latency p95, ms", [f"{x.p95_ms:.1f}" for x in figs], [x.p95_ms for x in figs])
    row(
        "hit rate (answers with cached tokens)",
        [f"{x.hit_rate:.2%}" for x in figs],
        [x.hit_rate for x in figs],
    )
    row(
        "prompt tokens served from cache",
        [f"{x.cached_share:.2%}" for x in figs],
        [x.cached_share for x in figs],
    )
    row(
        "later turns finding their whole conversation",
        [f"{x.whole_conversation:.2%}" for x in figs],
        [x.whole_conversation for x in figs],
    )
    moved = [switched(r) for r in runs]
    row("later turns sent to another replica", [f"{m[0]:.2%}" for m in moved])
    row("  whole conversation found, same replica", [f"{m[1]:.2%}" for m in moved])
    row("  whole conversation found, another replica", [f"{m[2]:.2%}" if m[0] else "-" for m in moved])
    row(
        "device-ms per answered request (Triton)",
        [f"{x.device_ms_per_answer:.1f}" for x in figs],
        [x.device_ms_per_answer for x in figs],
    )
    row("device-ms in all (Triton, both servers)", [f"{r.device_ms:.0f}" for r in runs])
    row(
        "device busy (of 4 devices over the run)",
        [f"{r.device_ms / (2 * DEVICES_PER_BACKEND * r.wall_s * 1000):.1%}" for r in runs],
    )
    row(
        f"device busy, {min(args.ramp_s, args.seconds / 2):g}-{args.seconds:g} s (of 4)",
        [f"{r.steady_busy:.1%}" for r in runs],
    )
    row("cross-tenant hits", [f"{x.cross_tenant}" for x in figs])
    for tenant in KEYS:
        row(f"  {tenant}'s first turn: cached tokens", [f"{x.first_turns.get(tenant, -1)}" for x in figs])
    for i in range(2):
        name = runs[0].backends[i].name
        row(
            f"{name}: share of executions / requests",
            [
                f"{r.backends[i].executions / max(1, sum(x.executions for x in r.backends)):.0%}"
                f" / {r.backends[i].requests / max(1, sum(x.requests for x in r.backends)):.0%}"
                for r in runs
            ],
        )
        row(
            f"{name}: mean queue time, ms (Triton)",
            [f"{r.backends[i].queue_ms / max(1, r.backends[i].requests):.2f}" for r in runs],
        )
        row(
            f"{name}: cache lookups / hits / evictions",
            [
                f"{r.backends[i].cache.get('lookups', 0)}/{r.backends[i].cache.get('hits', 0)}"
                f"/{r.backends[i].cache.get('evictions', 0)}"
                for r in runs
            ],
        )
    row(
        "gateway: prefix requests (metrics)",
        [f"{r.metrics.get('orchid_prefix_requests_total', 0):.0f}" for r in runs],
    )
    row(
        "gateway: expected hits (metrics)",
        [f"{r.metrics.get('orchid_prefix_expected_hits_total', 0):.0f}" for r in runs],
    )
    row(
        "gateway: prefix hits (metrics)",
        [f"{r.metrics.get('orchid_prefix_hits_total', 0):.0f}" for r in runs],
    )
    row(
        "gateway: saved accelerator-ms (metrics)",
        [f"{r.metrics.get('orchid_prefix_saved_accelerator_ms_total', 0):.0f}" for r in runs],
        [r.metrics.get("orchid_prefix_saved_accelerator_ms_total", 0.0) for r in runs],
    )
    row(
        "gateway: spills (metrics)",
        [f"{r.metrics.get('orchid_prefix_spills_total', 0):.0f}" for r in runs],
        [r.metrics.get("orchid_prefix_spills_total", 0.0) for r in runs],
    )
    row(
        f"gateway: max extra wait, ms (bound {bound:g}; max)",
        [f"{r.metrics.get('orchid_prefix_extra_wait_ms_max', 0):.2f}" for r in runs],
    )
    for r, x in zip(runs, figs, strict=True):
        print(f"\n{r.label}: every outcome {dict(x.outcomes.most_common())}; wall {r.wall_s:.1f} s")

    if "affinity" in by_label and "least-wait" in by_label:
        ia = by_label["affinity"]
        a, b = figs[ia], figs[by_label["least-wait"]]
        extra = runs[ia].metrics.get("orchid_prefix_extra_wait_ms_max", float("nan"))
        targets = [
            (
                "prefix-cache hit rate improves (prompt tokens served from cache over prompt tokens,"
                " the serving engines' measure, e.g. vLLM's prefix_cache_hit_rate)",
                a.cached_share > b.cached_share,
                f"{ratio(a.cached_share, b.cached_share)} ({a.cached_share:.2%} vs {b.cached_share:.2%})",
            ),
            (
                "(information) answers with any cached token: a turn hits its tenant's system prompt"
                " on either backend once both have seen it, so this share cannot separate the two",
                True,
                f"{ratio(a.hit_rate, b.hit_rate)} ({a.hit_rate:.2%} vs {b.hit_rate:.2%})",
            ),
            (
                "device-ms per answered request improves",
                a.device_ms_per_answer < b.device_ms_per_answer,
                ratio(a.device_ms_per_answer, b.device_ms_per_answer),
            ),
            ("on-time share equal or better", a.on_time >= b.on_time, f"{a.on_time:.2%} vs {b.on_time:.2%}"),
            (
                f"no backend's load beyond the bound (max extra wait <= {bound:g} ms)",
                extra <= bound,
                f"{extra:.2f} ms, {runs[ia].metrics.get('orchid_prefix_spills_total', 0):.0f} spills",
            ),
            (
                "no cross-tenant hit",
                all(x.cross_tenant == 0 for x in figs),
                " / ".join(str(x.cross_tenant) for x in figs),
            ),
        ]
        print("\nissue 32's targets (affinity against least-wait, this run):")
        for name, held, detail in targets:
            print(f"  {'HELD  ' if held else 'MISSED'} {name}: {detail}")

    replicated = [i for i, r in enumerate(runs) if r.replicas > 1]
    if replicated and "affinity" in by_label:
        a = figs[by_label["affinity"]]
        lw = figs[by_label["least-wait"]] if "least-wait" in by_label else None
        print("\nseveral replicas (issue 32: each replica keeps its own index; what that costs against one):")
        for i in replicated:
            x, r = figs[i], runs[i]
            print(
                f"  {r.label}: prompt tokens from cache {x.cached_share:.2%} vs {a.cached_share:.2%}"
                f" ({ratio(x.cached_share, a.cached_share)}); whole conversation {x.whole_conversation:.2%}"
                f" vs {a.whole_conversation:.2%}; device-ms per answer {x.device_ms_per_answer:.1f} vs"
                f" {a.device_ms_per_answer:.1f} ({ratio(x.device_ms_per_answer, a.device_ms_per_answer)});"
                f" on time {x.on_time:.2%} vs {a.on_time:.2%};"
                f" spills {r.metrics.get('orchid_prefix_spills_total', 0):.0f}"
                f" vs {runs[by_label['affinity']].metrics.get('orchid_prefix_spills_total', 0):.0f};"
                f" later turns on another replica {moved[i][0]:.2%}"
            )
            if lw is not None and a.cached_share != lw.cached_share:
                kept_cache = (x.cached_share - lw.cached_share) / (a.cached_share - lw.cached_share)
                kept_ms = (
                    (lw.device_ms_per_answer - x.device_ms_per_answer)
                    / (lw.device_ms_per_answer - a.device_ms_per_answer)
                    if lw.device_ms_per_answer != a.device_ms_per_answer
                    else float("nan")
                )
                print(
                    f"    of affinity's gain over least-wait it keeps {kept_cache:.0%} (tokens from cache)"
                    f" and {kept_ms:.0%} (device-ms per answer)"
                )
    return all(x.answered > 0 for x in figs)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0, help="conversations start in this window")
    parser.add_argument("--load", type=float, default=0.65, help="of the 4 devices, priced as least-wait")
    parser.add_argument("--time-factor", type=float, default=1.0)
    parser.add_argument("--deadline-ms", type=float, default=None, help="default: interactive's x f")
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--turns", type=int, nargs=2, default=[3, 8])
    parser.add_argument("--user-tokens", type=int, nargs=2, default=[32, 128])
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[32, 64])
    parser.add_argument("--think-s", type=float, nargs=2, default=[0.5, 2.0])
    parser.add_argument("--ramp-s", type=float, default=10.0, help="busy share measured from here")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    interactive = scaled_classes(args.time_factor)["interactive"]
    deadline_ms = (
        args.deadline_ms if args.deadline_ms is not None else float(interactive["default_deadline_ms"])
    )
    systems, conversations, rate = workload(args)
    turns = sum(len(c.turns) for c in conversations)
    print(f"workload: {len(conversations)} conversations, {turns} turns, seed {args.seed}", flush=True)
    labels = [t for t in args.targets.split(",") if t]
    unknown = [label for label in labels if label not in TARGETS]
    if unknown or not labels:
        raise SystemExit(f"unknown target(s) {unknown}: choose from {', '.join(TARGETS)}")
    tmp = tempfile.mkdtemp(prefix="orchid-prefix-affinity-")
    runs: list[Run] = []
    try:
        for label in labels:
            started = time.monotonic()
            runs.append(one_run(label, args, systems, conversations, deadline_ms / 1000.0, Path(tmp)))
            print(f"{label}: done in {time.monotonic() - started:.0f} s", flush=True)
    finally:
        if args.keep:
            print(f"work directory kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if not all(r.answered for r in runs):
        for r in runs:
            print(f"{r.label}: {len(r.answered)} of {r.requests} answered")
        return 1
    return 0 if report(runs, args, deadline_ms, rate) else 1


if __name__ == "__main__":
    sys.exit(main())
