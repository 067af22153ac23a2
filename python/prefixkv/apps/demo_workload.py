"""The demo's agent workload: a long system prompt, tool schemas and few-shot examples shared by
every request, then a varying user query and a timestamp line; and the reference model sizes it
runs on. `build_workload` writes it in either layout (stable content first, or query first), so
`prefixkv demo`, `prefixkv route-demo` and the benches serve the same requests.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from typing import Any

from prefixkv.models.decoder import ModelConfig
from prefixkv.text.tokenizers import ByteTokenizer

__all__ = ["FEW_SHOT", "MODEL_SIZES", "TOOLS", "build_workload"]

_BYTE_VOCAB = ByteTokenizer().vocab_size

#: Reference model sizes. "small" (the default) is big enough that prefill dominates the
#: engine's per-step overhead on a CPU, so the measured speedup is the cache's, not Python's.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=_BYTE_VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    "small": ModelConfig(
        vocab_size=_BYTE_VOCAB,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=384,
    ),
    "base": ModelConfig(
        vocab_size=_BYTE_VOCAB,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=768,
    ),
}

_SYSTEM_PROMPT = """\
You are Atlas, the operations agent of Northwind Logistics. You help dispatchers, warehouse \
leads and customer-support staff resolve shipment problems quickly and safely.

Principles:
1. Ground every answer in tool results. Never invent tracking numbers, addresses, prices or \
delivery dates; if a tool cannot tell you, say so and propose the next step.
2. Prefer the least invasive action. Look things up before changing them; ask for confirmation \
before rerouting a shipment, issuing a refund above 200 EUR or cancelling an order.
3. Be brief. Dispatchers read your answers on a handheld scanner: lead with the answer, then \
at most three short bullet points of supporting facts.
4. Escalate to a human supervisor when a shipment contains hazardous goods, when a customer \
mentions a safety incident, or when two tools disagree about a shipment's location.

Style: plain English, metric units, 24-hour times, amounts in EUR.
"""

TOOLS: list[dict[str, Any]] = [
    {
        "name": "track_shipment",
        "description": "Status, location and events of a shipment.",
        "parameters": {"tracking_number": "string, NW + 10 digits", "history": "boolean"},
    },
    {
        "name": "reroute_shipment",
        "description": "Send a shipment to another address or pickup point.",
        "parameters": {"tracking_number": "string", "destination": "string", "reason": "string"},
    },
    {
        "name": "issue_refund",
        "description": "Refund part or all of an order's shipping fee.",
        "parameters": {"order_id": "string", "amount_eur": "number", "reason": "string"},
    },
    {
        "name": "escalate",
        "description": "Hand the case to a human supervisor with a short summary.",
        "parameters": {"summary": "string", "severity": "low | medium | high"},
    },
]

FEW_SHOT: list[dict[str, str]] = [
    {"role": "user", "content": "Where is NW0048213377? The customer says it is two days late."},
    {
        "role": "assistant",
        "content": '{"tool": "track_shipment", "arguments": {"tracking_number": "NW0048213377", '
        '"history": true}}\nIt left RTM-2 yesterday at 18:40 and is at the Antwerp hub; '
        "new estimate tomorrow before 12:00.\n- Delay: missed linehaul on Monday\n"
        "- No action needed yet; offer a goodwill refund if it slips again",
    },
]

_QUERIES = [
    "Customer for NW{n} wants the parcel sent to pickup point AMS-PP-{k} instead.",
    "Is NW{n} still on schedule for delivery today?",
    "Order ORD-{k}{n4} arrived damaged; the customer asks for the shipping fee back.",
    "How many units of SKU CX-{k}0 are left across all warehouses?",
    "The driver reports a leaking drum in shipment NW{n}. What now?",
    "NW{n} shows delivered but the customer has nothing. Please check.",
    "Can you move NW{n} to the customer's office at Keizersgracht {k}?",
    "Refund the express surcharge on ORD-{k}{n4}, it came a day late.",
    "Which shipments for customer C-{n4} are due before 14:00?",
    "Two tools disagree on where NW{n} is. Which one should I trust?",
    "Stock check: SKU BX-{k}5 in Rotterdam and Antwerp.",
    "A customer asks why NW{n} went through Hamburg. Explain briefly.",
]


def build_workload(
    num_requests: int, seed: int, *, stable_first: bool, tools_in_system_prompt: bool = False
) -> list[dict[str, Any]]:
    """The agent requests as chat requests (``{"messages": ..., "tools": ...}``).

    Both layouts carry the same content in another order; query-first adds a one-line user
    turn that points at the query (about 1% more prompt tokens). With
    `tools_in_system_prompt` the tool schemas are written at the end of the system prompt as
    JSON (what agent frameworks do for a chat template that has no tool support) and the
    requests carry no ``tools``.
    """
    rng = random.Random(seed)
    start = dt.datetime(2025, 3, 14, 9, 0, 0, tzinfo=dt.UTC)
    requests = []
    for i in range(num_requests):
        query = rng.choice(_QUERIES).format(
            n=rng.randrange(10**9, 10**10), n4=rng.randrange(1000, 10000), k=rng.randrange(10, 99)
        )
        stamp = start + dt.timedelta(seconds=37 * i + rng.randrange(30))
        timestamp = f"Current time: {stamp.isoformat(timespec='seconds')}"
        base = _SYSTEM_PROMPT
        if tools_in_system_prompt:
            base += "\nTools (answer with one JSON call when a tool is needed):\n"
            base += "\n".join(json.dumps(tool) for tool in TOOLS) + "\n"
        if stable_first:
            system = base
            user = f"{query}\n{timestamp}"
        else:
            system = f"{timestamp}\nUser request: {query}\n\n{base}"
            user = "Please handle the user request above."
        messages = [{"role": "system", "content": system}, *FEW_SHOT]
        messages.append({"role": "user", "content": user})
        request: dict[str, Any] = {"messages": messages}
        if not tools_in_system_prompt:
            request["tools"] = TOOLS
        requests.append(request)
    return requests
