"""openai_api.py: the explorer's OpenAI-compatible API over its own rollout engine (Trinity-RFT's
`enable_openai_api`), so that a workflow written against the `openai` client runs unchanged.

    server = OpenAIServer(handle, "tiny-qwen2", record=True)    # explorer.rollout_model.enable_openai_api / _history
    url = server.start()                                         # http://127.0.0.1:<free port>
    client = server.client()                                     # an openai.OpenAI bound to a session of its own
    client.chat.completions.create(model="tiny-qwen2", messages=[...], n=4, logprobs=True,
                                   extra_body={"return_token_ids": True})
    exps = server.history(client)                                # every call of that session as Experiences
    exp = server.episode(client2)     # or a session's calls as ONE experience, when each extends the one before
    server.stop()

Endpoints (FastAPI on uvicorn, in a thread of the explorer; bound to 127.0.0.1 unless the config says otherwise):
GET /v1/models, POST /v1/chat/completions, POST /v1/completions; the same under /s/<session>/v1/, where calls
are recorded (enable_history) for that session. Responses follow OpenAI's shapes; `logprobs: true` adds each
sampled token's log-prob, `return_token_ids: true` (vLLM's request field) adds `prompt_token_ids` and each
choice's `token_ids`. /v1/completions takes the prompt as a string or, as OpenAI's and vLLM's do, as a list of
token ids: a multi-turn client continues from the exact ids it was given (prompt_token_ids + token_ids + the next
messages' ids), and `episode()` turns such a session into one experience. Sampling keys: n, temperature, top_p,
top_k, max_tokens / max_completion_tokens (unset: whatever max_model_len leaves, as vLLM does), min_tokens, stop,
seed; only max_model_len limits the rest (as in Trinity). Not served: streaming (400), top_logprobs > 0 (400: the
engines return the sampled token's log-prob only), tool-call parsing (tool calls stay in the text), several
prompts in one request (400). Messages the chat template cannot render (e.g. an assistant message with content
null) get a 400 that says why.
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
from workflows.episode import conversation_experience


class Request(BaseModel):
    """The fields of a chat or text completion request that nanorft reads; the rest of OpenAI's are accepted."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict] | None = None  # chat
    prompt: str | list | None = None  # completions: a string, or a list of token ids
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
        self.url = f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"
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
        model version), in call order. It ends the session: the client's later calls get a 404."""
        return [experience(c.prompt_ids, x, c.temperature) for c in self.take(client) for x in c.completions]

    def episode(self, client: Any, mask_truncated: bool = True) -> Experience:
        """The session's calls as ONE experience, when each call (n = 1) continued the conversation exactly: its
        prompt ids start with the previous call's prompt and reply ids. Built as an Episode's is
        (workflows.episode.conversation_experience): prompt = the first call's prompt; response = every later
        token; action_mask on the replies only (what came between them, the template's closing and the new
        messages, is never trained on), and none at all when the last reply was cut at its max_tokens or the
        context limit and `mask_truncated` (DAPO's overlong filtering; metrics truncated / truncated_masked).
        MixedTemperatures if the calls' temperatures differ. ValueError saying which call broke the chain
        otherwise, e.g. a chat template that re-renders history differently: continue with /v1/completions and
        token ids then, or use history() (one experience per call). Ends the session, as history() does."""
        calls = self.take(client)
        if not calls or any(len(c.completions) != 1 for c in calls):
            raise ValueError("an episode is one conversation: a session of calls with n = 1 each")
        ids, logprobs, mask = list(calls[0].prompt_ids), [], []
        for k, c in enumerate(calls):
            if c.prompt_ids[: len(ids)] != ids:
                raise ValueError(f"call {k + 1}'s prompt does not continue call {k}'s prompt and reply token for "
                                 "token (its history was rendered or tokenised again); send /v1/completions with "
                                 "the prompt as token ids to continue exactly, or use history()")
            gap, (reply,) = c.prompt_ids[len(ids):], c.completions
            ids += gap + reply.token_ids
            logprobs += [0.0] * len(gap) + list(reply.logprobs)
            mask += [False] * len(gap) + [True] * len(reply.token_ids)
        replies = [c.completions[0] for c in calls]
        return conversation_experience(self.handle.tokenizer, ids, len(calls[0].prompt_ids), logprobs, mask,
                                       [c.temperature for c in calls], [r.model_version for r in replies],
                                       truncated=replies[-1].truncated, mask_truncated=mask_truncated)

    def take(self, client: Any) -> list[Call]:
        """The calls of `client`'s session, which ends (its key is removed: no record is kept of it)."""
        session = str(client.base_url).rstrip("/").split("/")[-2]
        with self.lock:
            return self.sessions.pop(session, [])

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
        try:
            prompt = self.handle.render(body.messages, body.tools)
        except Exception as e:  # the client's messages, which the template cannot render: its error, not ours
            raise HTTPException(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}")
        call = self.run(body, self.handle.tokenizer.encode(prompt, add_special_tokens=False), session)
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason} | self.extras(body, c, chat=True)
                   for i, c in enumerate(call.completions)]
        return self.reply(body, call, "chat.completion", choices)

    def completions(self, body: Request, session: str = "") -> dict:
        prompt, vocab = body.prompt, len(self.handle.tokenizer)
        if isinstance(prompt, list) and not all(type(t) is int and 0 <= t < vocab for t in prompt):
            raise HTTPException(400, f"prompt: one prompt per request, a string or a list of token ids in [0, {vocab})")
        if prompt is None:
            raise HTTPException(400, "prompt is required (a string, or a list of token ids)")
        ids = prompt if isinstance(prompt, list) else self.handle.tokenizer.encode(prompt, add_special_tokens=False)
        call = self.run(body, ids, session)
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason} | self.extras(body, c, chat=False)
                   for i, c in enumerate(call.completions)]
        return self.reply(body, call, "text_completion", choices)

    def run(self, body: Request, ids: list[int], session: str) -> Call:
        """Sample the request's choices for the prompt `ids` from the engine (this runs in FastAPI's thread pool:
        it may block). Without max_tokens, a reply may fill what max_model_len leaves (vLLM's default)."""
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
        limit = self.handle.max_model_len
        if limit and "max_tokens" not in sampling:
            sampling["max_tokens"] = max(limit - len(ids), 1)
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
