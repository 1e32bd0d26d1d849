"""Config of the inference server (`tandem inference`)."""

from __future__ import annotations

from tandem.config.base import ProcessConfig, Section


class ServerConfig(Section):
    host: str = "127.0.0.1"
    """Address to bind; loopback by default so a run never listens on the network unasked."""

    port: int = 8000
    """TCP port of the OpenAI-compatible API."""

    api_key: str | None = None
    """When set, every request must carry `Authorization: Bearer <api_key>`."""


class InferenceConfig(ProcessConfig):
    server: ServerConfig = ServerConfig()
    """HTTP server settings."""
