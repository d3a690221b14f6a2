"""The routers' counters, in a module of their own: Ray ships a router class by value (its
module's globals copied), so counters defined beside it would not be the ones the ingress's
/metrics reads; both sides reach these through this module, imported by reference."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

ROUTER_REGISTRY = CollectorRegistry()
ROUTED = Counter("kvserve:router_requests", "Requests routed, by router, replica and reason",
                 ["router", "replica", "reason"], registry=ROUTER_REGISTRY)
PROMPT_BLOCKS = Counter("kvserve:router_prompt_blocks", "Full prompt blocks of the requests kv-aware routed",
                        registry=ROUTER_REGISTRY)
MATCHED_BLOCKS = Counter("kvserve:router_matched_blocks", "Prompt blocks the chosen replica was believed to hold "
                         "(kv-aware: the index's expected prefix hits)", registry=ROUTER_REGISTRY)
PREFILLS = Counter("kvserve:disaggregated_prefills", "Prompts sent to a prefill replica before their decode replica, "
                   "by outcome (done; failed: the decode replica computed the prompt itself)", ["outcome"],
                   registry=ROUTER_REGISTRY)
