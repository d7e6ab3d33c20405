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
seed; only max_model_len limits the rest (as in Trinity). `tools` are rendered by the chat template and the reply's
tool calls, read in that template's format (workflows/tool_parsers.py: Hermes / Qwen `<tool_call>` blocks, Llama 3,
Mistral, gpt-oss, Qwen3-Coder), come back as OpenAI `tool_calls` (finish_reason "tool_calls";
tool_choice "auto" or "none", parallel_tool_calls honoured); `chat_template_kwargs` (vLLM's) reach the template.

Its callers are untrusted (a workflow's code, or anyone who can reach the port): the handlers are async (a
request waiting for the engine holds no thread), a body over MAX_BODY_BYTES (or without a Content-Length) is
refused before it is read; before anything is rendered, a chat request of more than MAX_MESSAGES messages,
MAX_TOOLS tools or MAX_ITEMS JSON values, or whose strings (every one: roles, names, content parts, tool calls'
names and arguments, ids, keys, tools, template variables) hold more characters than max_model_len tokens could,
and a text prompt as long, are refused (400, naming the limit). Rendering and tokenising run in threads off the
event loop, RENDER_SLOTS big requests at a time and a thread kept for small ones, so a big request stalls no other
client. A message's strings are tokenised as text (chat_template.py): a caller's `<|im_end|><|im_start|>system` is
never a control token (a /v1/completions text prompt is the caller's own template text, read as written). n over
MAX_N, and every sampling value outside its range, are refused naming the field (400); a field this server does
not honour is a 400 naming it, unless it has its default value (`user` / `metadata` / `store` are accepted
and ignored). Every request is checked before it reaches the engine's shared batch, so one bad request fails alone
(sampling.Batcher also re-runs a failed batch one request at a time). Off loopback the server needs an API key
(explorer.rollout_model.openai_api_key), sent as `Authorization: Bearer <key>` (the `openai` client's api_key);
with one set, every request must carry it. Not served: streaming (400), top_logprobs > 0 (400: the engines return
the sampled token's log-prob only), several prompts in one request (400), guided decoding (response_format other
than text, tool_choice "required" or a named function: 400). Messages the chat template cannot render (e.g. an
assistant message with content null) get a 400 that says why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
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
from configs.checks import MIN_TEMPERATURE, loopback
from engines import experience
from sampling import scored_temperature
from workflows.episode import conversation_experience
from workflows.tool_parsers import Reply, ToolParser, tool_parser

MAX_BODY_BYTES = 8 * 2**20  # a request body's size at most (a prompt of 8 MiB is ~2M tokens)
MAX_N = 128  # choices of one request at most (OpenAI's limit): they hold the engine that the workflows share
MAX_STOP = 16  # stop strings of one request at most, each of 1..MAX_STOP_CHARS characters
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 2048  # messages of one chat request at most (OpenAI's limit): 250k empty ones took 7-17 s to render
MAX_TOOLS = 128  # tools of one request at most (OpenAI's limit)
MAX_ITEMS = (
    2**16
)  # JSON values (strings, numbers, lists, objects) in a request's messages, tools and template variables
RENDER_SLOTS = 2  # big requests rendered and tokenised at once, in threads off the event loop (the rest wait)
SMALL_CHARS = 16_384  # a request with fewer characters (and JSON values) is small: it never waits behind big ones
IGNORED = ("user", "metadata", "store")  # identifiers and OpenAI-side options: nothing here to honour
DEFAULTS = {  # fields served only at their default value (OpenAI's or vLLM's); another value is a 400
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "stream_options": (),
    "ignore_eos": (False,),
    "skip_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "spaces_between_special_tokens": (True,),
}
WHY = {
    "frequency_penalty": "penalties change the sampled distribution away from the one the trainer scores",
    "presence_penalty": "penalties change the sampled distribution away from the one the trainer scores",
    "repetition_penalty": "set model.repetition_penalty (the engine's, vLLM only) instead",
    "logit_bias": "a bias changes the sampled distribution away from the one the trainer scores",
    "response_format": "no guided decoding here",
}


class Request(BaseModel):
    """The fields of a chat or text completion request that nanorft reads; the others OpenAI or vLLM define are
    checked by name (DEFAULTS, IGNORED) and anything else is refused (OpenAIServer.check_fields)."""

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
    tool_choice: str | dict | None = None  # "auto" (or unset) | "none"
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: variables of the chat template (e.g. enable_thinking)
    stream: bool = False
    return_token_ids: bool = False


@dataclasses.dataclass
class Call:
    """One recorded request: its prompt ids and every choice's (sampling.Completion)."""

    prompt_ids: list[int]
    completions: list
    temperature: float
    min_tokens: int = 0  # the request's: EOS was masked before it (batching.eos_masked)


def error_body(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}  # OpenAI's shape, which its client reads


class Guard:
    """ASGI middleware in front of the app: the API key (when set) and the body cap, checked on the headers before
    any of the body is read. NOTE: a body without a Content-Length (chunked) is refused: its size is known only
    after reading it (the `openai` client always sends one)."""

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app, self.key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = None
        if self.key and not hmac.compare_digest(
            headers.get("authorization", "").encode(), f"Bearer {self.key}".encode()
        ):
            refusal = (401, "invalid_api_key", "a valid API key is required: send Authorization: Bearer <key>")
        elif scope["method"] == "POST":
            size = headers.get("content-length", "")
            if not size.isdigit():
                refusal = (
                    411,
                    "invalid_request_error",
                    "send the body with a Content-Length (chunked bodies are not accepted)",
                )
            elif int(size) > self.max_body:
                refusal = (
                    413,
                    "invalid_request_error",
                    f"the request body is {int(size)} bytes; at most {self.max_body} are accepted",
                )
        if refusal is None:
            return await self.app(scope, receive, send)
        code, kind, message = refusal
        await JSONResponse(error_body(message, kind, code), code)(scope, receive, send)


class OpenAIServer:
    """The API over `handle` (engines.EngineHandle) under the name `model_name`; `record`: keep each session's
    calls (enable_history); `api_key`: the bearer token every request must carry (required off loopback)."""

    def __init__(
        self,
        handle: Any,
        model_name: str,
        record: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        self.handle, self.name, self.record, self.host, self.port = handle, model_name, record, host, port
        self.api_key = api_key or None
        self.sessions: dict[str, list[Call]] = {}
        self.owners: dict[str, int] = {}  # session -> the thread that made its client (drop())
        self.lock = threading.Lock()
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.url = ""
        # a text of more characters than this cannot fit max_model_len tokens: refused before it is tokenised
        longest = max(map(len, handle.tokenizer.get_vocab()), default=1)  # >= the characters any token decodes to
        self.max_chars = handle.max_model_len * longest if handle.max_model_len else MAX_BODY_BYTES
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # the render threads (start())
        self.slots: asyncio.Semaphore | None = None

    # --- life cycle

    def start(self, timeout: float = 30.0) -> str:
        """Serve in a daemon thread; returns the base URL once the server accepts connections."""
        if not loopback(self.host) and not self.api_key:
            raise ValueError(
                f"the OpenAI-compatible API on {self.host!r} (not loopback) needs an API key: set "
                "explorer.rollout_model.openai_api_key"
            )
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # port 0: a free one, known before the server starts
        self.port = sock.getsockname()[1]
        app = Guard(self.app(), self.api_key, MAX_BODY_BYTES)
        # NOTE: rendering (Jinja) and tokenising a request run in these threads, so that one big request does not
        # stall every client's on the event loop; the semaphore keeps big requests waiting in the loop, not in
        # threads, and holds at most RENDER_SLOTS of the threads: the last one is always free for small requests
        self.pool = concurrent.futures.ThreadPoolExecutor(RENDER_SLOTS + 1, thread_name_prefix="openai-render")
        self.slots = asyncio.Semaphore(RENDER_SLOTS)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True, name="openai-api"
        )
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
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # --- sessions (enable_history)

    def client(self) -> Any:
        """An `openai.OpenAI` client whose calls are recorded in a session of their own."""
        import openai  # lazily: only workflows that use the API need the package

        for name in ("httpx", "httpx2"):  # the client's HTTP library logs every request at INFO: noise in the logs
            logging.getLogger(name).setLevel(logging.WARNING)
        session = uuid.uuid4().hex
        with self.lock:
            self.sessions[session], self.owners[session] = [], threading.get_ident()
        return openai.OpenAI(base_url=f"{self.url}/s/{session}/v1", api_key=self.api_key or "EMPTY", max_retries=0)

    def drop(self, owner: int) -> int:
        """End every session whose client thread `owner` made (a workflow's attempt, ended however: explore.run_task
        calls it, so that a failed or timed-out workflow's sessions and their recorded calls are not kept); their
        clients' later calls get a 404. Returns how many were ended."""
        with self.lock:
            ended = [k for k, o in self.owners.items() if o == owner]
            for k in ended:
                self.sessions.pop(k, None), self.owners.pop(k, None)
        return len(ended)

    def history(self, client: Any) -> list[Experience]:
        """Every choice of every call `client` made, as an Experience (prompt ids, response ids, log-probs,
        model version), in call order. It ends the session: the client's later calls get a 404."""
        return [
            experience(c.prompt_ids, x, c.temperature, min_tokens=c.min_tokens)
            for c in self.take(client)
            for x in c.completions
        ]

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
                raise ValueError(
                    f"call {k + 1}'s prompt does not continue call {k}'s prompt and reply token for "
                    "token (its history was rendered or tokenised again); send /v1/completions with "
                    "the prompt as token ids to continue exactly, or use history()"
                )
            gap, (reply,) = c.prompt_ids[len(ids) :], c.completions
            ids += gap + reply.token_ids
            logprobs += [0.0] * len(gap) + list(reply.logprobs)
            mask += [False] * len(gap) + [True] * len(reply.token_ids)
        replies = [c.completions[0] for c in calls]
        return conversation_experience(
            self.handle.tokenizer,
            ids,
            prompt_length=len(calls[0].prompt_ids),
            logprobs=logprobs,
            mask=mask,
            temperatures=[c.temperature for c in calls],
            versions=[r.model_version for r in replies],
            min_tokens=[c.min_tokens for c in calls],
            truncated=replies[-1].truncated,
            mask_truncated=mask_truncated,
        )

    def take(self, client: Any) -> list[Call]:
        """The calls of `client`'s session, which ends (its key is removed: no record is kept of it)."""
        session = str(client.base_url).rstrip("/").split("/")[-2]
        with self.lock:
            self.owners.pop(session, None)
            return self.sessions.pop(session, [])

    # --- the app

    def app(self) -> FastAPI:
        app = FastAPI(title="nanorft explorer", docs_url=None, redoc_url=None)

        @app.exception_handler(HTTPException)
        async def error(request: Any, e: HTTPException) -> JSONResponse:
            kind = "invalid_request_error" if e.status_code == 400 else "not_found_error"
            return JSONResponse(error_body(e.detail, kind, e.status_code), e.status_code)

        for prefix in ("", "/s/{session}"):
            app.get(prefix + "/v1/models")(self.models)
            app.post(prefix + "/v1/chat/completions")(self.chat)
            app.post(prefix + "/v1/completions")(self.completions)
        return app

    async def models(self, session: str = "") -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "nanorft",
                    "max_model_len": self.handle.max_model_len,
                }
            ],
        }

    async def chat(self, body: Request, session: str = "") -> dict:
        self.check_request(body, session)
        if body.messages is None:
            raise HTTPException(400, "messages is required")
        big = self.check_sizes(body)
        tool_choice = self.tool_choice(body)
        kwargs = body.chat_template_kwargs or {}
        clash = sorted(
            set(kwargs)
            & {
                "messages",
                "tools",
                "tokenize",
                "add_generation_prompt",
                "chat_template",
                "conversation",
                "documents",
                "continue_final_message",
                "return_dict",
            }
        )
        if clash:
            raise HTTPException(400, f"chat_template_kwargs: {clash} are not template variables")
        try:
            prompt, ids = await self.offload(big, self.render, body.messages, body.tools, kwargs)
        except Exception as e:  # the client's messages, which the template cannot render: its error, not ours
            raise HTTPException(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e
        call = await self.run(body, ids, session)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
            | self.extras(body, c, chat=True)
            for i, c in enumerate(call.completions)
        ]
        if body.tools and tool_choice == "auto":
            parser = tool_parser(self.handle.tokenizer, None, "auto", body.tools)
            for choice, c in zip(choices, call.completions):
                with_tool_calls(choice, self.read_calls(parser, c, prompt), body.parallel_tool_calls is not False)
        return self.reply(body, call, "chat.completion", choices)

    async def completions(self, body: Request, session: str = "") -> dict:
        self.check_request(body, session)
        prompt, vocab, limit = body.prompt, len(self.handle.tokenizer), self.handle.max_model_len
        if isinstance(prompt, list) and limit and len(prompt) >= limit:  # before checking each id: 4M fit the body
            raise HTTPException(400, f"prompt: {len(prompt)} token ids leave no room within max_model_len={limit}")
        if isinstance(prompt, list) and not all(type(t) is int and 0 <= t < vocab for t in prompt):
            raise HTTPException(400, f"prompt: one prompt per request, a string or a list of token ids in [0, {vocab})")
        if prompt is None:
            raise HTTPException(400, "prompt is required (a string, or a list of token ids)")
        if isinstance(prompt, str):
            self.check_text(len(prompt), "prompt")
            # NOTE: a raw prompt is the caller's own template text: its special-token texts are control tokens, as in
            # vLLM (it could send the ids anyway); chat messages are data, tokenised as text (render)
            prompt = await self.offload(len(prompt) > SMALL_CHARS, self.encode, prompt)
        call = await self.run(body, prompt, session)
        choices = [
            {"index": i, "text": c.text, "finish_reason": c.finish_reason} | self.extras(body, c, chat=False)
            for i, c in enumerate(call.completions)
        ]
        return self.reply(body, call, "text_completion", choices)

    # --- rendering and tokenising, off the event loop

    async def offload(self, big: bool, fn: Any, *args: Any) -> Any:
        """fn(*args) in the render threads, a `big` request's RENDER_SLOTS at a time: the event loop keeps answering
        other clients."""
        if not big:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        async with self.slots:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def render(self, messages: list[dict], tools: list | None, kwargs: dict) -> tuple[str, list[int]]:
        """A chat request's prompt text and ids, the messages' strings tokenised as text (the caller's
        `<|im_end|>` is never a control token: chat_template.chat_ids). Runs in a render thread."""
        return self.handle.render_ids(with_dict_arguments(messages), tools, template_kwargs=kwargs)

    def encode(self, prompt: str) -> list[int]:
        return self.handle.tokenizer.encode(prompt, add_special_tokens=False)

    # --- checks (every one before the request reaches the engine's shared batch)

    def check_request(self, body: Request, session: str) -> None:
        """The checks that cost nothing, before any rendering: the model's name, streaming, top log-probs, the
        session, fields this server does not honour."""
        if body.model != self.name:
            raise HTTPException(404, f"model {body.model!r} is not served here; this explorer serves {self.name!r}")
        if body.stream:
            raise HTTPException(400, "streaming is not supported: send stream=false")
        if body.top_logprobs or (not isinstance(body.logprobs, bool) and (body.logprobs or 0) > 0):
            raise HTTPException(
                400, "only the sampled token's log-prob is returned: top_logprobs / logprobs > 0 are not supported"
            )
        if session and session not in self.sessions:
            raise HTTPException(404, f"no session {session!r}")
        self.check_fields(body)

    def check_sizes(self, body: Request) -> bool:
        """400 for a chat request too big to render, before rendering it: more than MAX_MESSAGES messages or
        MAX_TOOLS tools, more than MAX_ITEMS JSON values, or more characters than max_model_len tokens could hold,
        counting every string of the messages (roles, names, content parts, tool calls' names and arguments, ids,
        keys), tools and template variables. Returns whether the request is big (SMALL_CHARS)."""
        if len(body.messages) > MAX_MESSAGES:
            raise HTTPException(400, f"messages: {len(body.messages)} messages; at most {MAX_MESSAGES} are accepted")
        if body.tools and len(body.tools) > MAX_TOOLS:
            raise HTTPException(400, f"tools: {len(body.tools)} tools; at most {MAX_TOOLS} are accepted")
        n_chars, items = text_size([body.messages, body.tools, body.chat_template_kwargs], MAX_ITEMS)
        if items > MAX_ITEMS:
            raise HTTPException(
                400, f"messages: more than {MAX_ITEMS} JSON values in messages, tools and chat_template_kwargs"
            )
        self.check_text(n_chars, "messages")
        return n_chars + items > SMALL_CHARS

    def check_text(self, n_chars: int, field: str) -> None:
        """400 for a text that cannot fit max_model_len tokens, before tokenising it (a 50 MiB message took minutes
        of CPU and ~10 GB to tokenise, only to be refused)."""
        if n_chars > self.max_chars:
            raise HTTPException(
                400,
                f"{field}: {n_chars} characters cannot fit max_model_len="
                f"{self.handle.max_model_len} tokens (at most {self.max_chars} characters)",
            )

    @staticmethod
    def tool_choice(body: Request) -> str:
        choice = body.tool_choice or "auto"
        if choice not in ("auto", "none"):
            raise HTTPException(
                400, f"tool_choice = {choice!r} is not supported (it needs guided decoding): send 'auto' or 'none'"
            )
        return choice

    @staticmethod
    def check_fields(body: Request) -> None:
        """400 naming a field this server does not honour, unless it has its default value."""
        for key, value in (body.model_extra or {}).items():
            if key in IGNORED or value is None or (key in DEFAULTS and value in DEFAULTS[key]):
                continue
            if key in DEFAULTS:
                raise HTTPException(
                    400,
                    f"{key} = {json.dumps(value)[:80]} is not supported"
                    f"{': ' + WHY[key] if key in WHY else ''}; leave it unset",
                )
            raise HTTPException(400, f"unsupported field {key!r}: this server does not honour it; leave it unset")

    def sampling(self, body: Request, n_prompt: int) -> dict:
        """The request's sampling arguments, each range-checked by name (sampling.check_request checks them again,
        with the handle's defaults)."""
        if not 1 <= body.n <= MAX_N:
            raise HTTPException(400, f"n = {body.n}: between 1 and {MAX_N}")
        t = body.temperature
        if t is not None and not (t == 0 or MIN_TEMPERATURE <= t <= 100):
            raise HTTPException(400, f"temperature = {t}: 0 (greedy) or between {MIN_TEMPERATURE} and 100")
        if body.top_p is not None and not 0 < body.top_p <= 1:
            raise HTTPException(400, f"top_p = {body.top_p}: in (0, 1]")
        if body.top_k is not None and not -1 <= body.top_k < 2**31:
            raise HTTPException(400, f"top_k = {body.top_k}: -1 or 0 (off), or a positive number below 2**31")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        for key, low, value in (("max_tokens", 1, max_tokens), ("min_tokens", 0, body.min_tokens)):
            if value is not None and not low <= value < 2**31:
                raise HTTPException(400, f"{key} = {value}: an integer in [{low}, 2**31)")
        room = (self.handle.max_model_len - n_prompt) if self.handle.max_model_len else None
        most = min((x for x in (max_tokens, room) if x is not None and x > 0), default=2**31)
        if body.min_tokens is not None and body.min_tokens > most:
            raise HTTPException(
                400,
                f"min_tokens = {body.min_tokens} is more than max_tokens or than the room the "
                f"prompt leaves within max_model_len ({most} tokens)",
            )
        if body.seed is not None and not -(2**63) <= body.seed < 2**63:
            raise HTTPException(400, f"seed = {body.seed}: an integer in [-2**63, 2**63)")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        if stop is not None and (len(stop) > MAX_STOP or not all(1 <= len(x) <= MAX_STOP_CHARS for x in stop)):
            raise HTTPException(400, f"stop: at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters")
        sampling = {
            "temperature": t,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "max_tokens": max_tokens,
            "min_tokens": body.min_tokens,
            "seed": body.seed,
            "stop": stop,
        }
        sampling = {k: v for k, v in sampling.items() if v is not None}
        if room and "max_tokens" not in sampling:
            sampling["max_tokens"] = max(room, 1)
        return sampling

    async def run(self, body: Request, ids: list[int], session: str) -> Call:
        """Sample the request's choices for the prompt `ids` from the engine; the handler awaits the engine's
        future (no thread is held meanwhile). Without max_tokens, a reply may fill what max_model_len leaves
        (vLLM's default)."""
        limit = self.handle.max_model_len
        sampling = self.sampling(body, len(ids))
        try:
            if limit and len(ids) >= limit:
                raise ValueError(
                    f"a prompt of {len(ids)} tokens leaves no room for a response within max_model_len={limit}"
                )
            params = self.handle.params(body.n, **sampling)
            params.max_tokens = min(params.max_tokens, limit - len(ids)) if limit else params.max_tokens
            future = self.handle.submit(ids, params)  # check_request: a bad request raises here, not in the batch
        except ValueError as e:  # a request no engine can serve (too long, bad sampling values)
            raise HTTPException(400, str(e)) from e
        call = Call(ids, await asyncio.wrap_future(future), scored_temperature(params), params.min_tokens)
        if session and self.record:
            with self.lock:
                if session in self.sessions:  # not ended (drop / history) while this call ran
                    self.sessions[session].append(call)
        return call

    def read_calls(self, parser: ToolParser, c: Any, prompt: str) -> Reply | None:
        """The tool calls of completion `c` in the format of the handle's chat template (workflows/tool_parsers.py):
        the text for hermes, the ids decoded with their special tokens after the prompt for the others; None if the
        parser fails (model output: this request must still be answered)."""
        try:
            if parser.template is None:
                return parser.parse(c.text)
            ids = c.token_ids[:-1] if c.token_ids and c.token_ids[-1] in self.handle.eos_ids else c.token_ids
            return parser.parse(c.text, self.handle.tokenizer.decode(ids, skip_special_tokens=False), prompt)
        except Exception:
            return None

    def extras(self, body: Request, c: Any, chat: bool) -> dict:
        """A choice's log-probs (logprobs) and token ids (return_token_ids)."""
        out: dict[str, Any] = {"token_ids": c.token_ids} if body.return_token_ids else {}
        if body.logprobs is not None and body.logprobs is not False:
            tokens = [self.handle.tokenizer.decode([t]) for t in c.token_ids]
            out["logprobs"] = (
                {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, c.logprobs)
                    ]
                }
                if chat
                else {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": []}
            )
        else:
            out["logprobs"] = None
        return out

    def reply(self, body: Request, call: Call, kind: str, choices: list[dict]) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in call.completions)
        out = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(call.prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(call.prompt_ids) + completion_tokens,
            },
        }
        return out | ({"prompt_token_ids": call.prompt_ids} if body.return_token_ids else {})


# --- messages in, tool calls out


def text_size(value: Any, budget: int) -> tuple[int, int]:
    """(characters of every string in `value`, dict keys included; JSON values counted), the count stopping once
    past `budget` values. NOTE: a loop, not recursion: a caller's nesting can be deep."""
    n_chars, items, stack = 0, 0, [value]
    while stack and items <= budget:
        x = stack.pop()
        items += 1
        if isinstance(x, str):
            n_chars += len(x)
        elif isinstance(x, dict):
            n_chars += sum(len(k) for k in x if isinstance(k, str))
            stack += x.values()
        elif isinstance(x, (list, tuple)):
            stack += x
    return n_chars, items


def with_dict_arguments(messages: list[dict]) -> list[dict]:
    """The messages with each assistant tool call's `arguments` as an object: OpenAI's clients send it as a JSON
    string, chat templates (Qwen's, Llama's) write it with `tojson` and expect an object, as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [with_dict_argument(c) for c in calls]}
        out.append(m)
    return out


def with_dict_argument(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**fn, "arguments": arguments}} if isinstance(arguments, dict) else call


def with_tool_calls(choice: dict, reply: Reply | None, parallel: bool) -> None:
    """An assistant reply's tool calls (`reply`: read in its chat template's format, read_calls) as OpenAI tool_calls:
    the text before them (the answer's region for a response template) stays the content; finish_reason
    "tool_calls", as vLLM's parsers return them. A reply whose calls do not all parse stays text, so the client sees
    what the model wrote."""
    if reply is None or not reply.calls or any(c.error for c in reply.calls):
        return
    choice["message"]["content"] = reply.content.strip() or None
    choice["message"]["tool_calls"] = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in reply.calls[: None if parallel else 1]
    ]
    choice["finish_reason"] = "tool_calls"
