"""The OpenAI-compatible HTTP server (docs/server.md): `create_app(engine, cfg)`, `python -m metrale serve`.

Its names load on first use, so the engine process (engine_child.py) imports neither FastAPI nor uvicorn."""
from __future__ import annotations

from typing import Any

__all__ = ["create_app", "ServerThread", "main", "EngineProcess"]
_WHERE = {"create_app": "metrale.server.app", "ServerThread": "metrale.server.serve", "main": "metrale.server.serve",
          "EngineProcess": "metrale.server.engine_process"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'metrale.server' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_WHERE[name]), name)
