"""The vLLM backend: `tandem inference --backend vllm` runs vLLM's OpenAI server under tandem's config."""
