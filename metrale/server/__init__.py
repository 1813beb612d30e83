"""The OpenAI-compatible HTTP server (docs/server.md): `create_app(engine, cfg)`, `python -m metrale serve`."""
from metrale.server.app import create_app
from metrale.server.serve import ServerThread, main

__all__ = ["create_app", "ServerThread", "main"]
