"""kvtool serve: an OpenAI-compatible HTTP server over kvtool's engine (routes in app.py, the engine
task in engine_loop.py, request and answer bodies in protocol.py, reading bodies in body.py, API
keys in auth.py, the drain on shutdown in drain.py, /metrics in prometheus.py, uvicorn in server.py)."""

from kvtool.serve.server import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def create_app(llm, *, served_model_name: str, config: ServeConfig | None = None):
    """The FastAPI app serving ``llm``; ``config`` gives its API key and body size limit (imported here on
    use: FastAPI loads only when serving)."""
    from kvtool.serve.app import create_app as create

    return create(llm, served_model_name=served_model_name, config=config)
