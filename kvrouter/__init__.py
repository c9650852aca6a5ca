"""kvrouter: a KV-cache-aware request router for LLM inference fleets."""
