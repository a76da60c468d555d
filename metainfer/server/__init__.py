"""`metainfer serve`: an OpenAI-compatible HTTP server whose engine is an optimized model's
continuous batching (transformers' engine, every step on metainfer's graphs).

- protocol: what a request may say (OpenAI's completions and chat completions, plus token ids
  in and out), checked into a `GenerationRequest`; responses and errors in OpenAI's shapes;
- engine: the asyncio side of the batching engine: admission (running cap, bounded queue),
  each request's outputs routed to its handler, cancellation, drain;
- metrics: the Prometheus collectors /metrics serves;
- app: the FastAPI application (routes, API key, SSE streaming) and `run`, which serves it
  with uvicorn until SIGTERM/SIGINT and drains.

The FastAPI / uvicorn / prometheus-client dependencies are the `serve` extra; nothing here is
imported by `import metainfer`.
"""
