"""Memory management for the paged KV cache. Knows nothing about models."""
