"""``kvserve bench serve`` / ``kvserve bench report``: a load tester for any OpenAI-compatible
server that sweeps concurrency or request rate, measures TTFT/TPOT/ITL/latency per request
and the server's KV usage and memory from /metrics, and finds the knee."""
