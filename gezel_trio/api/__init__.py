"""The Quart-Trio front end: OpenAI-compatible, native passthrough, admin, metrics."""
