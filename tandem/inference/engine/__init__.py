"""tandem's inference engine: continuous batching over a paged KV cache.

`llm_engine.LLMEngine` is the synchronous core (one `step()` = schedule -> run -> postprocess);
`async_engine.AsyncEngine` runs it in a background thread for the HTTP server.
"""
