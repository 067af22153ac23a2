"""`prefixkv route-demo`: engine instances in their own processes, routed by their KV events.

Each instance is a separate process running an `Engine` whose cache publishes its KV events
(`KVEventPublisher`: ZMQ PUB plus replay socket, vLLM's format) on a loopback port chosen at run
time. The router process keeps a `PrefixIndex` fed by an `EventSubscriber` and sends each request
of an agent workload (several agents, each with its own long system prompt, asking in turns) to
the instance holding the longest prefix of its prompt; a request whose prefix nobody holds goes
to the instance with the fewest requests so far. The same workload then runs round-robin on
fresh instances. Each instance's pool holds about half of the agents' prompts, so round-robin,
which sends every agent everywhere, keeps evicting what the next request needs.

The router waits, after each response, until the index has applied the instance's batch for it
(`EventSubscriber.wait_for`): routing then sees every earlier request, as it would in a server
where requests are seconds apart. (llm-d covers the gap between a routing decision and its
events with speculative entries; this demo has no such gap.)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from prefixkv.events import Endpoint, EventSubscriber, PrefixIndex, prompt_hashes

__all__ = ["RouteDemoResult", "WorkerHandle", "format_route_table", "run_route_demo"]

_AGENT_ROLES = [
    "the dispatch planner of a freight company",
    "a customer-support agent for a cloud storage provider",
    "a code-review assistant for a Rust compiler team",
    "the triage nurse assistant of a telehealth service",
    "a travel-booking concierge for a corporate account",
    "a compliance checker for bank wire transfers",
]


def agent_prompts(
    num_agents: int, rounds: int, seed: int, prompt_chars: int
) -> list[tuple[int, str]]:
    """(agent, prompt) pairs: round after round, each agent asks once, agents in shuffled order.
    Every prompt is the agent's long system prompt followed by its query."""
    rng = random.Random(seed)
    systems = []
    for agent in range(num_agents):
        role = _AGENT_ROLES[agent % len(_AGENT_ROLES)]
        words = [
            f"rule {i}: agent {agent} must check item {rng.randrange(10**6)}" for i in range(400)
        ]
        header = f"Agent {agent}. You are {role}. Follow every rule below.\n"
        systems.append((header + "; ".join(words))[:prompt_chars] + "\n")
    requests = []
    for turn in range(rounds):
        order = list(range(num_agents))
        rng.shuffle(order)
        for agent in order:
            query = f"User (turn {turn}): status of order {rng.randrange(10**8)}, please?"
            requests.append((agent, systems[agent] + query))
    return requests


# ------------------------------------------------------------------------------ the instances


def _worker_main(conn: Connection, name: str, config: dict[str, Any]) -> None:
    """One engine instance: serves requests from `conn`, publishes its KV events."""
    import torch

    from prefixkv.apps.demo_workload import MODEL_SIZES
    from prefixkv.cache import PrefixCache
    from prefixkv.engine.facade import Engine
    from prefixkv.events import KVEventPublisher
    from prefixkv.models.decoder import LlamaModel

    torch.set_num_threads(1)
    model = LlamaModel.random(MODEL_SIZES[config["model_size"]], seed=config["seed"])
    engine = Engine(
        model,
        num_blocks=config["num_blocks"],
        block_size=config["block_size"],
        model_id="route-demo",
    )
    assert isinstance(engine.cache, PrefixCache)  # the demo model has one KV group
    publisher = KVEventPublisher(
        engine.cache,
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        topic=f"kv@{name}@route-demo",
        medium="CPU",
    )
    context = engine.cache.context
    conn.send(
        {
            "events": publisher.endpoint,
            "replay": publisher.replay_endpoint,
            "topic": f"kv@{name}@route-demo",
            "fingerprint": context.fingerprint(),
            "block_size": context.block_size,
        }
    )
    try:
        while True:
            command, argument = conn.recv()
            if command == "generate":
                result = engine.generate([argument], max_new_tokens=config["max_new_tokens"])[0]
                publisher.flush()
                conn.send(
                    {
                        "ttft": result.time_to_first_token,
                        "cached_tokens": result.cached_tokens,
                        "prompt_tokens": result.prompt_tokens,
                        "seq": publisher.socket.next_sequence - 1,
                    }
                )
            elif command == "encode":
                conn.send(engine.encode(argument))
            elif command == "cached_hashes":
                conn.send(
                    sorted(int.from_bytes(k[-8:], "big") for k in publisher.recorder.cached_keys())
                )
            elif command == "clear":
                engine.cache.clear()
                publisher.flush()
                conn.send(publisher.socket.next_sequence - 1)
            else:
                break
    finally:
        publisher.close()
        conn.close()


class WorkerHandle:
    """An engine instance in its own process, driven over a pipe."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(child, name, config), name=f"prefixkv-{name}", daemon=True
        )
        self.process.start()
        child.close()
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        """The instance's endpoints and context, once it has started."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout} s")
        self.info = self._conn.recv()
        return self.info

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.info["events"], self.info["replay"], self.info["topic"])

    def call(self, command: str, argument: Any = None) -> Any:
        self._conn.send((command, argument))
        return self._conn.recv()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self._conn.send(("exit", None))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()


def start_workers(count: int, config: dict[str, Any]) -> list[WorkerHandle]:
    """`count` instances, started in parallel, each ready."""
    workers = [WorkerHandle(f"engine{i}", config) for i in range(count)]
    try:
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            worker.close()
        raise
    return workers


# ------------------------------------------------------------------------------ the router


@dataclass
class PolicyResult:
    """One routing policy over the workload."""

    policy: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    per_instance: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class RouteDemoResult:
    """Both policies, and what the index saw."""

    instances: int
    requests: int
    agents: int
    results: list[PolicyResult]
    index_blocks: int = 0


def _serve(
    policy: str,
    workers: Sequence[WorkerHandle],
    requests: Sequence[tuple[int, str]],
    tokens: dict[str, list[int]],
) -> PolicyResult:
    names = [w.name for w in workers]
    index = PrefixIndex(names)
    endpoints = {w.name: w.endpoint for w in workers}
    result = PolicyResult(policy, per_instance=dict.fromkeys(names, 0))
    fingerprint, block_size = workers[0].info["fingerprint"], workers[0].info["block_size"]
    start = time.perf_counter()
    with EventSubscriber(index, endpoints) as subscriber:
        for position, (_, prompt) in enumerate(requests):
            if policy == "round-robin":
                target = names[position % len(names)]
            else:
                hashes = prompt_hashes(fingerprint, tokens[prompt], block_size=block_size)
                target, matched = index.best(hashes)
                if matched == 0:
                    target = min(names, key=lambda n: (result.per_instance[n], n))
            worker = workers[names.index(target)]
            reply = worker.call("generate", tokens[prompt])
            subscriber.wait_for(target, reply["seq"])
            result.per_instance[target] += 1
            result.prompt_tokens += reply["prompt_tokens"]
            result.cached_tokens += reply["cached_tokens"]
            result.ttfts.append(reply["ttft"])
    result.wall_s = time.perf_counter() - start
    return result


def run_route_demo(
    *,
    instances: int = 2,
    agents: int = 4,
    rounds: int = 4,
    prompt_chars: int = 1500,
    model_size: str = "small",
    block_size: int = 16,
    max_new_tokens: int = 2,
    seed: int = 0,
) -> RouteDemoResult:
    """Runs the workload prefix-routed, then round-robin, each on fresh instances."""
    requests = agent_prompts(agents, rounds, seed, prompt_chars)
    # Each pool holds the prompts of about half the agents (plus room for one request).
    blocks_per_prompt = -(-(prompt_chars + 80 + max_new_tokens) // block_size)
    config = {
        "model_size": model_size,
        "seed": seed,
        "block_size": block_size,
        "num_blocks": max(
            blocks_per_prompt * max(1, agents // instances) + 2, blocks_per_prompt + 2
        ),
        "max_new_tokens": max_new_tokens,
    }
    results = []
    index_blocks = 0
    for policy in ("prefix", "round-robin"):
        workers = start_workers(instances, config)
        try:
            tokens = {prompt: workers[0].call("encode", prompt) for _, prompt in requests}
            results.append(_serve(policy, workers, requests, tokens))
            if policy == "prefix":
                index_blocks = sum(len(w.call("cached_hashes")) for w in workers)
        finally:
            for worker in workers:
                worker.close()
    return RouteDemoResult(instances, len(requests), agents, results, index_blocks)


def format_route_table(result: RouteDemoResult) -> str:
    """The side-by-side table `prefixkv route-demo` prints."""

    def median_ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.1f} ms" if values else "-"

    def p90_ms(values: list[float]) -> str:
        if not values:
            return "-"
        ordered = sorted(values)
        return f"{ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3:.1f} ms"

    columns = result.results
    lines = [
        f"prefixkv route-demo: {result.requests} requests from {result.agents} agents over "
        f"{result.instances} engine processes, routed by their KV events (ZMQ, vLLM format)",
        "",
        f"{'':32}" + "".join(f"{c.policy:>16}" for c in columns),
        f"{'prefix cache hit rate':32}" + "".join(f"{c.hit_rate:>16.1%}" for c in columns),
        f"{'prefill tokens computed':32}"
        + "".join(f"{c.prompt_tokens - c.cached_tokens:>16,}" for c in columns),
        f"{'median time to first token':32}"
        + "".join(f"{median_ms(c.ttfts):>16}" for c in columns),
        f"{'p90 time to first token':32}" + "".join(f"{p90_ms(c.ttfts):>16}" for c in columns),
        f"{'requests per instance':32}"
        + "".join(f"{'/'.join(str(v) for v in c.per_instance.values()):>16}" for c in columns),
    ]
    return "\n".join(lines)
