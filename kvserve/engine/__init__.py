"""Scheduling, sampling and the engine loop."""
