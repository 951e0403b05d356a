"""Simulated engines for fleet-scale runs: the real HTTP API, scheduler, KV cache and KV events with a
fitted step time instead of a model (docs/simulation.md)."""
