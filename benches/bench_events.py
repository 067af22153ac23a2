"""KV events and the prefix index: what recording costs a request, how fast the index takes
updates, and how long a router waits for a score.

1. Events off vs on, per request (begin + commit + finish of a 2k-token prompt whose last 10%
   is new, on a pool small enough that every request also evicts), on each core (the default
   and `core="runs"`): four caches served the same requests interleaved, request by request, so
   machine drift hits each alike:
   - off: no recorder;
   - recorded: the core records, and Python drains it after every request (no transport);
   - published: `KVEventPublisher.flush()` after every request: drain, msgpack (in Rust), ZMQ
     PUB send (no subscriber: a PUB socket drops, it never waits);
   - published / 8: one flush per 8 requests, as an engine flushing once per scheduler step
     with 8 requests in the step would.
2. Index updates: blocks/s through `PrefixIndex.store` + `remove` (16 hashes a call, as a
   16-block commit arrives), and batches/s through the full subscriber path (msgpack decode +
   apply).
3. Score latency for a 4096-token prompt (256 blocks of 16) against 8 instances, each holding a
   different share of the prompt among 50,000 unrelated blocks: p50 / p99 of `score` on the
   prompt's hashes, and of `prompt_hashes` + `score` (what a router pays per request).

    python benches/bench_events.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_us, gc_paused, machine, md_table, now, write_json

from prefixkv import CacheContext, PrefixCache
from prefixkv import _core as core
from prefixkv.events import EventRecorder, KVEventPublisher, PrefixIndex
from prefixkv.events.publisher import wire_events
from prefixkv.events.wire import KVEventBatch, decode_batch, encode_batch

BLOCK = 16


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def request_overhead(num_requests: int, core_name: str) -> dict[str, Any]:
    rng = random.Random(0)
    shared = [rng.randrange(32000) for _ in range(1843)]
    prompts = [shared + [rng.randrange(32000) for _ in range(205)] for _ in range(num_requests)]
    context = CacheContext(model_id="bench-events", block_size=BLOCK)
    # 512 blocks: the shared prefix (116) plus a few dozen requests' tails; the rest evicts.
    variants = ("off", "recorded", "published", "published / 8")
    caches = {name: PrefixCache(512, context=context, core=core_name) for name in variants}
    recorder = EventRecorder(caches["recorded"])
    publisher = KVEventPublisher(caches["published"], "tcp://127.0.0.1:*")
    stepped = KVEventPublisher(caches["published / 8"], "tcp://127.0.0.1:*")
    served = [0]

    def every_8th() -> None:
        served[0] += 1
        if served[0] % 8 == 0:
            stepped.flush()

    def serve(cache: PrefixCache, tokens: list[int]) -> None:
        request = cache.begin(tokens)
        cache.commit(request, len(tokens))
        cache.finish(request)

    after = {
        "off": lambda: None,
        "recorded": recorder.drain,
        "published": publisher.flush,
        "published / 8": every_8th,
    }
    samples: dict[str, list[float]] = {name: [] for name in caches}
    with gc_paused():
        for position, tokens in enumerate(prompts):
            order = list(caches)
            turn = position % len(order)
            order = order[turn:] + order[:turn]  # rotate who goes first
            for name in order:
                start = now()
                serve(caches[name], tokens)
                after[name]()
                samples[name].append(now() - start)
    publisher.close()
    stepped.close()
    counters = recorder.counters()
    warm = num_requests // 10  # the first requests fill the pool; eviction starts after
    medians = {name: statistics.median(s[warm:]) for name, s in samples.items()}
    return {
        "requests": num_requests,
        "prompt_tokens": len(prompts[0]),
        "median_ns": medians,
        "overhead_recorded": medians["recorded"] / medians["off"] - 1,
        "overhead_published": medians["published"] / medians["off"] - 1,
        "overhead_published_per_8": statistics.mean(samples["published / 8"][warm:])
        / statistics.mean(samples["off"][warm:])
        - 1,
        "mean_ns": {name: statistics.mean(s[warm:]) for name, s in samples.items()},
        "blocks_recorded": counters.recorded_blocks,
        "blocks_dropped": counters.dropped_blocks,
        "evictions": caches["recorded"].stats().evictions,
    }


def index_updates(num_calls: int) -> dict[str, Any]:
    rng = random.Random(1)
    batches = [[rng.getrandbits(64) for _ in range(16)] for _ in range(num_calls)]
    index = core.PrefixIndex(8)
    with gc_paused():
        start = now()
        for i, hashes in enumerate(batches):
            index.store(i % 8, hashes)
        store_ns = now() - start
        start = now()
        for i, hashes in enumerate(batches):
            index.remove(i % 8, hashes)
        remove_ns = now() - start
    # The full subscriber path: a prefixkv batch of one 16-block commit, decoded and applied.
    cache = PrefixCache(64, context=CacheContext(model_id="bench", block_size=BLOCK), core="blocks")
    recorder = EventRecorder(cache)
    request = cache.begin([rng.randrange(32000) for _ in range(16 * BLOCK)])
    cache.commit(request, 16 * BLOCK)
    events = wire_events(recorder.drain().events, block_size=BLOCK, medium="GPU")
    payload = encode_batch(KVEventBatch(ts=0.0, events=events))
    router = PrefixIndex(["a"])
    n_payloads = max(1, num_calls // 4)
    with gc_paused():
        start = now()
        for seq in range(n_payloads):
            router.apply("a", decode_batch(payload), seq)
        apply_ns = now() - start
    blocks = 16 * num_calls
    return {
        "store_blocks_per_s": blocks / (store_ns / 1e9),
        "remove_blocks_per_s": blocks / (remove_ns / 1e9),
        "decode_apply_batches_per_s": n_payloads / (apply_ns / 1e9),
        "decode_apply_blocks_per_s": 16 * n_payloads / (apply_ns / 1e9),
    }


def score_latency(iterations: int, background: int) -> dict[str, Any]:
    rng = random.Random(2)
    cache = PrefixCache(1, context=CacheContext(model_id="bench", block_size=BLOCK), core="blocks")
    prompt = [rng.randrange(32000) for _ in range(4096)]
    from prefixkv.events import prompt_hashes

    hashes = prompt_hashes(cache, prompt)
    assert len(hashes) == 256
    names = [f"engine{i}" for i in range(8)]
    index = PrefixIndex(names)
    for i, name in enumerate(names):
        index.store(name, hashes[: 32 * i])  # instance i holds the first 32*i blocks
        index.store(name, [rng.getrandbits(64) for _ in range(background)])
    assert index.score(hashes)["engine7"] == 224
    raw = index._core  # the binding alone, as a router holding a list of ints calls it
    score_samples = []
    full_samples = []
    with gc_paused():
        for _ in range(iterations):
            start = now()
            raw.score(hashes)
            score_samples.append(now() - start)
        for _ in range(max(1, iterations // 5)):
            start = now()
            index.score(prompt_hashes(cache, prompt))
            full_samples.append(now() - start)
    return {
        "prompt_tokens": 4096,
        "instances": 8,
        "blocks_in_index": len(index),
        "score_p50_ns": percentile(score_samples, 0.5),
        "score_p99_ns": percentile(score_samples, 0.99),
        "hash_and_score_p50_ns": percentile(full_samples, 0.5),
        "hash_and_score_p99_ns": percentile(full_samples, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = {
        "machine": machine(),
        "overhead": {
            name: request_overhead(150 if args.quick else 600, name) for name in ("blocks", "runs")
        },
        "index": index_updates(5_000 if args.quick else 50_000),
        "score": score_latency(2_000 if args.quick else 10_000, 5_000 if args.quick else 50_000),
    }
    i, s = result["index"], result["score"]
    print(
        f"machine: {result['machine']['cpu']}, core build {result['machine']['prefixkv_core_build']}"
    )
    for core_name, o in result["overhead"].items():
        print_overhead(core_name, o)
    print("\n2. index updates")
    print(
        md_table(
            ["path", "rate"],
            [
                ["store (16 hashes a call)", f"{i['store_blocks_per_s']:,.0f} blocks/s"],
                ["remove (16 hashes a call)", f"{i['remove_blocks_per_s']:,.0f} blocks/s"],
                [
                    "decode + apply (16-block batch)",
                    f"{i['decode_apply_batches_per_s']:,.0f} batches/s "
                    f"({i['decode_apply_blocks_per_s']:,.0f} blocks/s)",
                ],
            ],
        )
    )
    print(f"\n3. score, 4096-token prompt, 8 instances, {s['blocks_in_index']:,} blocks indexed")
    print(
        md_table(
            ["call", "p50 µs", "p99 µs"],
            [
                ["score(hashes)", fmt_us(s["score_p50_ns"]), fmt_us(s["score_p99_ns"])],
                [
                    "prompt_hashes + score",
                    fmt_us(s["hash_and_score_p50_ns"]),
                    fmt_us(s["hash_and_score_p99_ns"]),
                ],
            ],
        )
    )
    if args.json:
        write_json(args.json, result)


def print_overhead(core_name: str, o: dict[str, Any]) -> None:
    m = o["median_ns"]
    print(
        f"\n1. per request, core={core_name!r} ({o['prompt_tokens']} tokens, "
        f"{o['requests']} requests, {o['evictions']} evictions), median µs"
    )
    print(
        md_table(
            ["events", "µs / request", "overhead"],
            [
                ["off", fmt_us(m["off"]), "–"],
                ["recorded + drained", fmt_us(m["recorded"]), f"{o['overhead_recorded']:+.1%}"],
                ["published (ZMQ)", fmt_us(m["published"]), f"{o['overhead_published']:+.1%}"],
                [
                    "published, 1 flush / 8 requests (mean)",
                    fmt_us(o["mean_ns"]["published / 8"]),
                    f"{o['overhead_published_per_8']:+.1%} (vs mean off "
                    f"{fmt_us(o['mean_ns']['off'])})",
                ],
            ],
        )
    )


if __name__ == "__main__":
    main()
