"""The HTTP API: every dialect the clients speak (OpenAI chat, completions and
Responses, Anthropic messages, llama.cpp's native routes, Ollama), sessions, admin,
status and metrics, on a Quart-Trio app with a lean front (:mod:`.lean`) for the hot
completion routes."""
