"""pagedkv: a paged KV-cache memory system for LLM inference."""
