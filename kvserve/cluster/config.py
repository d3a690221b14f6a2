"""``kvserve serve --ray`` settings, checked before Ray starts."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError

ROUTER_NAMES = ("kv-aware", "power-of-two", "round-robin")
# kv-aware's load bounds, chosen in benchmarks/ray_routing.py (docs/benchmarks.md): any KV-usage
# bound short of 1 (off) and request bounds under 8 cost prefix hits there and bought nothing
MAX_REQUEST_IMBALANCE = 8.0
MAX_KV_IMBALANCE = 1.0


@dataclass(slots=True)
class ClusterConfig:
    num_replicas: int = 2
    router: str = "kv-aware"
    ray_address: str | None = None  # None: start a local Ray instance (or join RAY_ADDRESS)
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0  # 0 with a CUDA --device: one GPU each
    max_ongoing_requests: int = 320  # per replica; Ray tries another replica past it
    max_request_imbalance: float = MAX_REQUEST_IMBALANCE  # kv-aware: requests over the least-loaded one
    max_kv_imbalance: float = MAX_KV_IMBALANCE  # kv-aware: KV usage over the least-loaded one
    # prefill/decode disaggregation: both >= 1 (num_replicas is then decode_replicas), or neither
    prefill_replicas: int = 0
    decode_replicas: int = 0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"--num-replicas must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTER_NAMES:
            raise ConfigError(f"--router must be one of {', '.join(ROUTER_NAMES)}, got {self.router!r}")
        if self.cpus_per_replica <= 0:
            raise ConfigError(f"--cpus-per-replica must be positive, got {self.cpus_per_replica}")
        if self.gpus_per_replica < 0:
            raise ConfigError(f"--gpus-per-replica must be >= 0, got {self.gpus_per_replica}")
        if self.max_ongoing_requests < 1:
            raise ConfigError(f"--max-ongoing-requests must be >= 1, got {self.max_ongoing_requests}")
        if self.max_request_imbalance < 0:
            raise ConfigError(f"--router-max-request-imbalance must be >= 0, got {self.max_request_imbalance}")
        if not 0 <= self.max_kv_imbalance <= 1:
            raise ConfigError(f"--router-max-kv-imbalance must be in [0, 1], got {self.max_kv_imbalance}")
        for flag, count in (("--prefill-replicas", self.prefill_replicas), ("--decode-replicas", self.decode_replicas)):
            if count < 0:
                raise ConfigError(f"{flag} must be >= 0, got {count}")
        if (self.prefill_replicas == 0) != (self.decode_replicas == 0):
            raise ConfigError(f"--prefill-replicas and --decode-replicas go together (>= 1 each), got "
                              f"{self.prefill_replicas} and {self.decode_replicas}")
        if self.disaggregated:
            self.num_replicas = self.decode_replicas

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    def check_engine(self, kv_offload_remote: str | None) -> None:
        """Disaggregation hands a prompt's blocks over through the shared store: it needs one."""
        if self.disaggregated and kv_offload_remote is None:
            raise ConfigError("--prefill-replicas/--decode-replicas hand each prompt's KV to its decode replica "
                              "through the shared store: give --kv-offload-remote (and --kv-offload-memory)")
