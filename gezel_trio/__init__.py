"""gezel-trio: a local LLM inference host on Trio structured concurrency."""

__version__ = "0.1.0"
