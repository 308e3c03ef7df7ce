"""The OpenAI-compatible HTTP server (``pagedkv serve``): `api_server.build_app` /
`api_server.create_app` and the modules behind its routes.

    api_server.py          the FastAPI app factory and the small routes
    protocol.py            pydantic request/response models (OpenAI's fields + vLLM's extensions)
    serving_engine.py      what the completion and chat handlers share (engine calls, usage)
    serving_completion.py  POST /v1/completions
    serving_chat.py        POST /v1/chat/completions
    streaming.py           SSE event streams, cut short when the client goes away
    validation.py          body parsing and context-length checks (400s with OpenAI's wording)
    errors.py              OpenAI-shaped error responses and exception handlers
    middleware.py          API key, body size limit, access log

Metrics, the stats logger and the dashboard are in `pagedkv.entrypoints` (see its docstring).
"""
