"""What users run: the ``pagedkv`` command and the servers behind it.

    cli/           the ``pagedkv`` command (main.py) and one module per subcommand; the top of
                   the house: nothing in pagedkv imports it
    openai/        the OpenAI-compatible HTTP server: the app (api_server.py), its request and
                   response models (protocol.py), the completion/chat handlers, SSE streaming,
                   validation, OpenAI-shaped errors and the HTTP middleware
    proxy.py       the prefill/decode proxy's app (its forwarding lives in `pagedkv.forwarding`,
                   shared with the router)
    metrics.py     Prometheus metrics of one server (vLLM's names)
    stat_logger.py the server's periodic stats line and the wiring of its observability options
    dashboard.py   the live KV-cache dashboard (static/dashboard.html)

metrics, stat_logger and dashboard stay here rather than in openai/: they observe the engine
behind any front end (the dashboard and metrics read `SchedulerStats`, not OpenAI requests),
and the server is only their first user.
"""
