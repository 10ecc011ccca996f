"""autotune: find the best LLM serving configuration under a latency SLA."""

__version__ = "0.1.0"
