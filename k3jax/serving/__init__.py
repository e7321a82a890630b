"""OpenAI-compatible serving: continuous batching over a slot cache, prefix caching, HTTP routes."""
