"""The gateway's HTTP server: an OpenAI-compatible ``/v1/chat/completions`` (and ``/v1/models``)
on 127.0.0.1, a free port, in the rollout's own asyncio loop; one `Session` per API key.

A request whose ``Authorization: Bearer <key>`` names no open episode gets HTTP 401
(``invalid_api_key``); a `RequestError` HTTP 400 (503 for an engine failure) with its code, and
marks the episode with the error's status; a gateway bug HTTP 500 and ``agent_error`` for that
episode only. `shared_gateway()` is the running loop's server, started on first use.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from aiohttp import web

from sao_megatron.rollout.engine import SERVED_MODEL_NAME
from sao_megatron.rollout.gateway.rendering import RequestError
from sao_megatron.rollout.gateway.session import Session
from sao_megatron.rollout.status import EpisodeStatus

log = logging.getLogger("sao_megatron.rollout.gateway")


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        status=status,
    )


class ChatGateway:
    """The OpenAI-compatible server (``/v1/chat/completions``, ``/v1/models``) of one event loop.

    Usage (inside the loop)::

        gw = await ChatGateway().start()     # 127.0.0.1, a free port
        session = gw.open_session(...)        # per episode; session.key is its API key
        ...                                    # the agent calls gw.base_url with that key
        gw.close_session(session)
        await gw.aclose()
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self.serving = False  # True once it listens on its port

    @property
    def base_url(self) -> str:
        """The ``base_url`` for ``openai.AsyncOpenAI`` (ends in ``/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> ChatGateway:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self.serving = True
        return self

    async def aclose(self) -> None:
        self.serving = False
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, **kw: Any) -> Session:
        key = f"sao-{secrets.token_hex(12)}"
        s = Session(self, key=key, **kw)
        self.sessions[key] = s
        return s

    def close_session(self, session: Session) -> None:
        self.sessions.pop(session.key, None)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": SERVED_MODEL_NAME, "object": "model", "owned_by": "sao_megatron"}],
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        session = self.sessions.get(auth.removeprefix("Bearer ").strip())
        if session is None:
            return _error(401, "unknown API key: not an open RL episode", "invalid_api_key")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            return web.json_response(await session.complete(body))
        except RequestError as e:
            if e.status is not None:
                session.fail(e.status, str(e))
            http = 503 if e.code == "engine_error" else 400
            return _error(http, str(e), e.code)
        except ValueError as e:  # bad JSON
            session.fail(EpisodeStatus.AGENT_ERROR, f"malformed request: {e}")
            return _error(400, f"malformed request: {e}", "invalid_request")
        except Exception as e:  # a gateway bug: fail this episode loudly, keep serving others
            log.exception("gateway error in episode %s", session.episode_id)
            session.fail(EpisodeStatus.AGENT_ERROR, f"gateway error {type(e).__name__}: {e}")
            return _error(500, f"gateway error: {e}", "internal_error")


#: id(loop) -> (loop, its gateway, the lock that serialises starting it)
_SHARED: dict[int, tuple[asyncio.AbstractEventLoop, ChatGateway | None, asyncio.Lock]] = {}


async def shared_gateway() -> ChatGateway:
    """The gateway of the running event loop, started on first use (one port per loop).

    Concurrent first calls (the first wave of episodes) all wait for the one start: a gateway
    is handed out only once it listens on its port."""
    loop = asyncio.get_running_loop()
    entry = _SHARED.get(id(loop))
    if entry is None or entry[0] is not loop:  # a new loop (ids of dead loops are reused)
        entry = _SHARED[id(loop)] = (loop, None, asyncio.Lock())
    async with entry[2]:
        _, gw, lock = _SHARED[id(loop)]
        if gw is None or not gw.serving:
            gw = await ChatGateway().start()
            _SHARED[id(loop)] = (loop, gw, lock)
    return gw


async def close_shared_gateway() -> None:
    """Stop the running loop's shared gateway (the manager's `_shutdown` calls it)."""
    loop = asyncio.get_running_loop()
    entry = _SHARED.pop(id(loop), None)
    if entry is not None and entry[0] is loop and entry[1] is not None:
        await entry[1].aclose()
