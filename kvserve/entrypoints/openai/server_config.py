"""The HTTP server's own settings (the engine's are EngineConfig): one record, so the CLI,
the app and the lifecycle read the same values."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    served_model_name: list[str] | None = None
    """Names clients may use; the first is the one reported (None: the model argument)."""
    api_keys: list[str] = field(default_factory=list)
    """Bearer keys accepted on /v1/* and the admin routes (none: no key needed)."""
    metrics_require_key: bool = False
    request_timeout: float | None = None
    max_waiting_requests: int | None = None
    max_request_bytes: int = 16 * 2**20
    """Bodies larger than this are refused with 413 before they are parsed."""
    shutdown_timeout: float = 30.0
    """On SIGTERM/SIGINT, how long in-flight requests may take to finish."""
    stream_stall_timeout: float | None = 60.0
    """A stream whose client has not read for this long (send buffer full) is aborted."""
    engine_restart_limit: int = 3
    """How many times in a row a dead engine core is restarted."""
    routing_policy: str = "cache-aware"
    """With --data-parallel-size > 1: round-robin | least-loaded | session | cache-aware."""
    allowed_origins: list[str] = field(default_factory=list)
    """CORS: browser origins allowed to call the API (empty: no CORS headers at all)."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    response_store: str = "memory"
    """Responses API store: memory | sqlite:PATH (kept across restarts)."""
    response_store_size: int = 1024
    """Responses API: how many stored responses are kept for previous_response_id (LRU)."""
    metrics_compat: str | None = None
    """"vllm": /metrics also carries each series under its vllm:* name."""
    web_ui: bool = True
    """The chat at / and the dashboard at /dashboard (--disable-web-ui turns them off)."""
    batch_storage_dir: str | None = None
    """Batch API: where uploaded files, outputs and the job database live (None: the user's
    data dir, $XDG_DATA_HOME/kvserve/batch)."""
    max_upload_size: int = 200 * 2**20
    """Batch API: the largest file POST /v1/files accepts (OpenAI's limit is 200 MB)."""
    batch_window: int | None = None
    """Batch API: how many of a batch's requests are in the engine at once (None: max_num_seqs)."""
    max_logprobs: int = 20
    """--max-logprobs: the most top alternatives a request may ask for (-1: the vocabulary)."""
    chat_template: str | None = None
    """--chat-template: the Jinja template chat requests are rendered with (None: the model's)."""
    log_requests: bool = True
    """One log line per API request (--disable-log-requests turns it off)."""
    uvicorn_log_level: str = "warning"
    """uvicorn's own log level (--uvicorn-log-level; info adds its access log)."""
    root_path: str = ""
    """--root-path: the URL prefix a reverse proxy serves this server under ('' none)."""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    """--ssl-keyfile / --ssl-certfile: serve HTTPS (uvicorn's TLS) instead of HTTP."""
