"""The FastAPI app. Routes only translate between HTTP and the `TokenizerManager` (which validates,
tokenizes and talks to the scheduler); the serving classes hold the translation of the bigger routes.

Routes: POST|PUT /generate; POST /v1/completions, /v1/chat/completions; GET /v1/models[/{id}];
GET /health, /health_generate; GET /get_server_info (/server_info), /get_model_info (/model_info);
GET /get_load, /v1/loads (load reports for routers); GET|POST /flush_cache; POST /abort_request;
GET|POST /start_profile, /stop_profile (torch profiler traces, scheduler/profiler.py);
GET /metrics (with --enable-metrics).

Lifecycle: the app owns the TokenizerManager given to it. At startup a warm-up generation runs in the
background; /health answers 503 until it has finished, and a failed warm-up is fatal (`on_fatal`). At
shutdown (SIGINT/SIGTERM, or `on_fatal`) the lifespan stops the scheduler (and any detokenizer) processes.
With --api-key every route but /health and /metrics needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenloom.config import ServerArgs
from tokenloom.entrypoints.body_limit import BodyLimitMiddleware
from tokenloom.entrypoints.loads import legacy_load, loads_prometheus, loads_report
from tokenloom.entrypoints.metrics import CONTENT_TYPE, render_metrics
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tokenloom.entrypoints.openai.serving_chat import ChatServing
from tokenloom.entrypoints.openai.serving_completions import CompletionServing
from tokenloom.entrypoints.openapi_bodies import ABORT_REQUEST_SCHEMA, json_request_body, model_request_body
from tokenloom.entrypoints.serving_generate import GenerateReqInput, GenerateServing
from tokenloom.entrypoints.serving_utils import (
    BadRequestBody,
    abort_error,
    body_error,
    format_validation_errors,
    read_json_body,
    require_object,
)
from tokenloom.frontend.tokenizer_manager import EngineDeadError, TokenizerManager
from tokenloom.models.default_model import DEFAULT_MODEL_ALIAS
from tokenloom.protocol import HEALTH_CHECK_RID_PREFIX, WARMUP_RID_PREFIX
from tokenloom.scheduler.profiler import PROFILE_FIELDS
from tokenloom.tokenizer import generation_defaults
from tokenloom.version import __version__

logger = logging.getLogger("tokenloom.server")

WARMUP_PROMPT = "The capital city of France is"
WARMUP_MAX_NEW_TOKENS = 8
HEALTH_CHECK_TIMEOUT_S = 20.0
OPEN_PATHS = frozenset({"/health", "/metrics"})


@dataclass
class ServerState:
    tm: TokenizerManager
    args: ServerArgs
    model_name: str
    on_fatal: Callable[[str], None]
    ready: bool = False
    shutting_down: bool = False


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or args.model_path or DEFAULT_MODEL_ALIAS


def public_server_args(args: ServerArgs) -> dict[str, Any]:
    info = dataclasses.asdict(args)
    if info.get("api_key"):
        info["api_key"] = "<redacted>"
    return info


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would hide client disconnects from the routes)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse({"error": {
                    "message": "Unauthorized: a valid 'Authorization: Bearer <api key>' header is required.",
                    "type": "invalid_request_error", "code": 401}}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(tm: TokenizerManager, args: ServerArgs, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    state = ServerState(tm, args, served_model_name(args), on_fatal or (lambda reason: None))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.receive_on_loop()  # outputs go to the requests' queues from this loop, not via a thread
        warmup = asyncio.create_task(warm_up(state))
        try:
            yield
        finally:
            state.shutting_down = True
            warmup.cancel()
            tm.receive_on_thread()
            tm.shutdown()

    app = FastAPI(title="tokenloom", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)  # inside the key check
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    _add_error_handlers(app)
    _add_routes(app, state)
    app.state.server = state
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BadRequestBody)
    async def bad_body(request: Request, exc: BadRequestBody) -> Response:
        return body_error(exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return body_error(format_validation_errors(list(exc.errors())))

    @app.exception_handler(EngineDeadError)
    async def dead(request: Request, exc: EngineDeadError) -> Response:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=503)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        """A bug, not the client's fault: a JSON 500 (Starlette still logs the traceback); the server serves on."""
        return JSONResponse({"error": {"message": f"Internal server error ({type(exc).__name__}); the server "
                                                  "log has the details."}}, status_code=500)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    tm, args = state.tm, state.args
    generate = GenerateServing(tm)
    completions = CompletionServing(tm, state.model_name)
    chat = ChatServing(tm, state.model_name, generation_defaults(tm.source))

    # The handlers read their bodies themselves; openapi_extra documents them in /openapi.json (openapi_bodies.py).
    app.add_api_route("/generate", generate.handle, methods=["POST", "PUT"],
                      openapi_extra=model_request_body(GenerateReqInput))
    app.add_api_route("/v1/completions", completions.handle, methods=["POST"],
                      openapi_extra=model_request_body(CompletionRequest))
    app.add_api_route("/v1/chat/completions", chat.handle, methods=["POST"],
                      openapi_extra=model_request_body(ChatCompletionRequest))

    def model_card() -> ModelCard:
        return ModelCard(id=state.model_name, root=tm.source.path, max_model_len=tm.context_len)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if model_id != state.model_name:
            return JSONResponse({"error": {"message": f"The model '{model_id}' does not exist",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}}, status_code=404)
        return JSONResponse(model_card().model_dump())

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if await health_check(state) else 503)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Response:
        internal = await tm.get_internal_state()
        internal["token_usage"] = internal["kv_tokens_in_use"] / max(internal["max_total_num_tokens"], 1)
        startup = {k: v for k, v in tm.scheduler_info.items() if k != "status"}
        return JSONResponse({**public_server_args(args), **startup, **internal, "internal_states": [internal],
                             "served_model_name": state.model_name, "version": __version__,
                             "process_ids": {name: p.pid for name, p in tm.processes.items()}})

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> Response:
        config = tm.source.config
        return JSONResponse({
            "model_path": tm.source.path, "tokenizer_path": args.tokenizer_path or tm.source.tokenizer_dir,
            "is_generation": True, "preferred_sampling_params": generation_defaults(tm.source) or None,
            "weight_version": "default", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": config.architecture.removesuffix("ForCausalLM").lower(),
            "architectures": [config.architecture], "context_length": tm.context_len,
            "vocab_size": tm.vocab_size})

    @app.get("/get_load")
    async def get_load() -> Response:
        return JSONResponse(legacy_load(await tm.get_internal_state()))

    @app.get("/v1/loads")
    async def get_loads(include: str | None = None, dp_rank: int | None = None, format: str = "json") -> Response:
        if format not in ("json", "prometheus"):
            return body_error(f"format must be 'json' or 'prometheus', got {format!r}")
        try:
            report = loads_report(await tm.get_internal_state(), __version__, include, dp_rank)
        except ValueError as e:
            return body_error(str(e))
        if format == "prometheus":
            return Response(loads_prometheus(report), media_type=CONTENT_TYPE)
        return JSONResponse(report)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        reply = await tm.flush_cache()
        return PlainTextResponse(reply.message, status_code=200 if reply.success else 400)

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request) -> Response:
        empty = not (await request.body()).strip()  # SGLang's body is optional: no body, every default
        body = {} if empty else require_object(await read_json_body(request, require_json_type=False))
        try:
            reply = await tm.start_profile(**{k: v for k, v in body.items() if k in PROFILE_FIELDS})
        except ValueError as e:
            return body_error(str(e))
        return PlainTextResponse(reply.message + "\n") if reply.success else body_error(reply.message)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        reply = await tm.stop_profile()
        return PlainTextResponse(reply.message + "\n") if reply.success else body_error(reply.message)

    @app.post("/abort_request", openapi_extra=json_request_body(ABORT_REQUEST_SCHEMA))
    async def abort_request(request: Request) -> Response:
        body = require_object(await read_json_body(request, require_json_type=False))
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if abort_all is True:
            tm.abort_all()
        elif isinstance(rid, str) and rid:
            tm.abort(rid)
        else:
            return body_error("abort_request needs a 'rid' (string) or 'abort_all': true")
        return Response(status_code=200)

    if args.enable_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            body = render_metrics(await tm.get_internal_state(), tm.metrics, state.model_name)
            return Response(body, media_type=CONTENT_TYPE)


async def warm_up(state: ServerState) -> None:
    """One short greedy generation through the whole runtime; the server is healthy only after it."""
    tm = state.tm
    try:
        ids = tm.tokenizer(WARMUP_PROMPT).input_ids[: max(1, tm.context_len // 2)]
        max_new = max(0, min(WARMUP_MAX_NEW_TOKENS, tm.context_len - len(ids) - 1))
        req = tm.tokenize_request(None, ids, {"max_new_tokens": max_new, "temperature": 0},
                                  rid=f"{WARMUP_RID_PREFIX}{uuid.uuid4().hex}")
        out: dict[str, Any] = {}
        async for out in tm.generate_request(req):  # noqa: B007 - only the final output matters
            pass
        error = abort_error(out)
        if error is not None:
            raise RuntimeError(error[1])
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means the server cannot serve
        logger.error("warm-up generation failed: %s", e)
        state.on_fatal(f"warm-up generation failed: {e}")
        return
    state.ready = True
    logger.info("The server is fired up and ready to roll! (http://%s:%d, model %s)", state.args.host,
                state.args.port, state.model_name)


async def health_check(state: ServerState) -> bool:
    """Healthy when the runtime produces output: a 1-token generation is submitted and the check passes
    as soon as any output arrives after it began (so it is cheap under load)."""
    tm = state.tm
    if not state.ready or state.shutting_down or tm.dead_error is not None:
        return False
    start = time.monotonic()
    req = tm.tokenize_request(None, [0], {"max_new_tokens": 1, "temperature": 0},
                              rid=f"{HEALTH_CHECK_RID_PREFIX}{uuid.uuid4().hex}")

    async def run() -> None:
        async for _ in tm.generate_request(req):
            pass

    task = asyncio.ensure_future(run())
    try:
        while time.monotonic() - start < HEALTH_CHECK_TIMEOUT_S:
            done, _ = await asyncio.wait({task}, timeout=0.05)
            if done:
                return task.exception() is None
            if tm.last_output_time > start:
                return True
        return False
    finally:
        task.cancel()
