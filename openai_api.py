"""openai_api.py: the explorer's OpenAI-compatible API over its own rollout engine (Trinity-RFT's
`enable_openai_api`), so that a workflow written against the `openai` client runs unchanged.

    server = OpenAIServer(handle, "tiny-qwen2", record=True)    # explorer.rollout_model.enable_openai_api / _history
    url = server.start()                                         # http://127.0.0.1:<free port>
    client = server.client()                                     # an openai.OpenAI bound to a session of its own
    client.chat.completions.create(model="tiny-qwen2", messages=[...], n=4, logprobs=True,
                                   extra_body={"return_token_ids": True})
    exps = server.history(client)                                # every call of that session as Experiences
    server.stop()

Endpoints (FastAPI on uvicorn, in a thread of the explorer; bound to 127.0.0.1 unless the config says otherwise):
GET /v1/models, POST /v1/chat/completions, POST /v1/completions; the same under /s/<session>/v1/, where calls
are recorded (enable_history) for that session. Responses follow OpenAI's shapes; `logprobs: true` adds each
sampled token's log-prob, `return_token_ids: true` (vLLM's request field) adds `prompt_token_ids` and each
choice's `token_ids`. Sampling keys: n, temperature, top_p, top_k, max_tokens / max_completion_tokens, min_tokens,
stop, seed; only max_model_len limits the rest (as in Trinity). Not served: streaming (400), top_logprobs > 0
(400: the engines return the sampled token's log-prob only), tool-call parsing (tool calls stay in the text).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from buffer import Experience
from engines import experience, scored_temperature


class Request(BaseModel):
    """The fields of a chat or text completion request that nanorft reads; the rest of OpenAI's are accepted."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict] | None = None  # chat
    prompt: str | None = None  # completions
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | int | None = None  # chat: bool; completions: an int (top-k), 0 = the sampled token's
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    stream: bool = False
    return_token_ids: bool = False


@dataclasses.dataclass
class Call:
    """One recorded request: its prompt ids and every choice's (engines.Completion)."""

    prompt_ids: list[int]
    completions: list
    temperature: float


class OpenAIServer:
    """The API over `handle` (engines.ModelHandle) under the name `model_name`; `record`: keep each session's
    calls (enable_history)."""

    def __init__(self, handle: Any, model_name: str, record: bool = False, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.handle, self.name, self.record, self.host, self.port = handle, model_name, record, host, port
        self.sessions: dict[str, list[Call]] = {}
        self.lock = threading.Lock()
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.url = ""

    # --- life cycle

    def start(self, timeout: float = 30.0) -> str:
        """Serve in a daemon thread; returns the base URL once the server accepts connections."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # port 0: a free one, known before the server starts
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="openai-api")
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the OpenAI-compatible API did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)

    # --- sessions (enable_history)

    def client(self) -> Any:
        """An `openai.OpenAI` client whose calls are recorded in a session of their own."""
        import openai  # lazily: only workflows that use the API need the package

        for name in ("httpx", "httpx2"):  # the client's HTTP library logs every request at INFO: noise in the logs
            logging.getLogger(name).setLevel(logging.WARNING)
        session = uuid.uuid4().hex
        with self.lock:
            self.sessions[session] = []
        return openai.OpenAI(base_url=f"{self.url}/s/{session}/v1", api_key="EMPTY", max_retries=0)

    def history(self, client: Any) -> list[Experience]:
        """Every choice of every call `client` made, as an Experience (prompt ids, response ids, log-probs,
        model version), in call order; the session's record is emptied."""
        session = str(client.base_url).rstrip("/").split("/")[-2]
        with self.lock:
            calls, self.sessions[session] = self.sessions.get(session, []), []
        return [experience(c.prompt_ids, x, c.temperature) for c in calls for x in c.completions]

    # --- the app

    def app(self) -> FastAPI:
        app = FastAPI(title="nanorft explorer", docs_url=None, redoc_url=None)

        @app.exception_handler(HTTPException)
        def error(request: Any, e: HTTPException) -> JSONResponse:  # OpenAI's error shape, which its client reads
            kind = "invalid_request_error" if e.status_code == 400 else "not_found_error"
            return JSONResponse({"error": {"message": e.detail, "type": kind, "code": e.status_code}}, e.status_code)

        for prefix in ("", "/s/{session}"):
            app.get(prefix + "/v1/models")(self.models)
            app.post(prefix + "/v1/chat/completions")(self.chat)
            app.post(prefix + "/v1/completions")(self.completions)
        return app

    def models(self, session: str = "") -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "nanorft",
                                            "max_model_len": self.handle.max_model_len}]}

    def chat(self, body: Request, session: str = "") -> dict:
        if body.messages is None:
            raise HTTPException(400, "messages is required")
        prompt = self.handle.render(body.messages, body.tools)
        call = self.run(body, prompt, session)
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason} | self.extras(body, c, chat=True)
                   for i, c in enumerate(call.completions)]
        return self.reply(body, call, "chat.completion", choices)

    def completions(self, body: Request, session: str = "") -> dict:
        if body.prompt is None:
            raise HTTPException(400, "prompt is required (one string)")
        call = self.run(body, body.prompt, session)
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason} | self.extras(body, c, chat=False)
                   for i, c in enumerate(call.completions)]
        return self.reply(body, call, "text_completion", choices)

    def run(self, body: Request, prompt: str, session: str) -> Call:
        """Sample the request's choices from the engine (this runs in FastAPI's thread pool: it may block)."""
        if body.model != self.name:
            raise HTTPException(404, f"model {body.model!r} is not served here; this explorer serves {self.name!r}")
        if body.stream:
            raise HTTPException(400, "streaming is not supported: send stream=false")
        if body.top_logprobs or (not isinstance(body.logprobs, bool) and (body.logprobs or 0) > 0):
            raise HTTPException(400, "only the sampled token's log-prob is returned: top_logprobs / logprobs > 0 "
                                     "are not supported")
        if session and session not in self.sessions:
            raise HTTPException(404, f"no session {session!r}")
        sampling = {k: v for k, v in {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                                      "max_tokens": body.max_completion_tokens or body.max_tokens,
                                      "min_tokens": body.min_tokens, "seed": body.seed,
                                      "stop": [body.stop] if isinstance(body.stop, str) else body.stop}.items()
                    if v is not None}
        ids, limit = self.handle.tokenizer.encode(prompt, add_special_tokens=False), self.handle.max_model_len
        try:
            if limit and len(ids) >= limit:
                raise ValueError(f"a prompt of {len(ids)} tokens leaves no room for a response within "
                                 f"max_model_len={limit}")
            params = self.handle.params(body.n, **sampling)
            params.max_tokens = min(params.max_tokens, limit - len(ids)) if limit else params.max_tokens
            completions = self.handle.submit(ids, params).result()
        except ValueError as e:  # a request no engine can serve (too long, bad sampling values)
            raise HTTPException(400, str(e)) from e
        call = Call(ids, completions, scored_temperature(params))
        if session and self.record:
            with self.lock:
                self.sessions[session].append(call)
        return call

    def extras(self, body: Request, c: Any, chat: bool) -> dict:
        """A choice's log-probs (logprobs) and token ids (return_token_ids)."""
        out: dict[str, Any] = {"token_ids": c.token_ids} if body.return_token_ids else {}
        if body.logprobs is not None and body.logprobs is not False:
            tokens = [self.handle.tokenizer.decode([t]) for t in c.token_ids]
            out["logprobs"] = ({"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                            for t, lp in zip(tokens, c.logprobs)]} if chat else
                               {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None,
                                "text_offset": []})
        else:
            out["logprobs"] = None
        return out

    def reply(self, body: Request, call: Call, kind: str, choices: list[dict]) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in call.completions)
        out = {"id": f"cmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": self.name,
               "choices": choices, "usage": {"prompt_tokens": len(call.prompt_ids),
                                             "completion_tokens": completion_tokens,
                                             "total_tokens": len(call.prompt_ids) + completion_tokens}}
        return out | ({"prompt_token_ids": call.prompt_ids} if body.return_token_ids else {})
