"""The inference server: an OpenAI-compatible HTTP API over tandem's own engine (or vLLM)."""
