"""Scale-out: kvserve replicas on Ray Serve (``kvserve serve --ray``). Importing this package
does not import ray; ``deploy`` and ``routers`` do."""
