"""Gateway configuration: one YAML file validated with pydantic.

A mistake stops start-up with one line naming the key path (``model_list.1.backend.timeout:
...``), so an operator never has to read a traceback to find a typo.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration problem; str() is one line: 'key.path: problem'."""


class _Strict(BaseModel):
    # .inf and .nan are floats too: an infinite timeout made every reservation's TTL infinite,
    # which Redis could not be sent (OverflowError: a 500 for each request); an infinite weight
    # or price broke routing and budgets the same way
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _secret(value: str | None, path: str) -> str | None:
    """'env:NAME' reads the environment; anything else is the literal value."""
    if value is None or not value.startswith("env:"):
        return value
    name = value[4:]
    if name not in os.environ:
        raise ConfigError(f"{path}: environment variable {name} is not set")
    return os.environ[name]


def _store_url(v: str) -> str:
    """A state or cache store: 'memory' or a Redis URL."""
    if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must be 'memory' or a redis:// URL")
    return v


_MAX_LIMIT = 10**15
_MAX_SECONDS = 10**6  # (~12 days) a bound on times, so a TTL in milliseconds stays an integer


class Limits(_Strict):
    """Limits shared by keys and teams; None means unlimited."""

    # bounded, finite: an rpm of 10**400 was stored and then each request's float arithmetic
    # raised; an infinite budget could not be written as JSON
    rpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    tpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    max_parallel_requests: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    max_budget: float | None = Field(None, ge=0, allow_inf_nan=False)
    budget_duration: str | None = None

    _duration = field_validator("budget_duration")(lambda v: _checked_duration(v))


class Backend(_Strict):
    base_url: str
    api_key: str | None = None
    model: str
    timeout: float = Field(600.0, gt=0, le=_MAX_SECONDS, description="total seconds for one attempt")
    connect_timeout: float = Field(5.0, gt=0, le=_MAX_SECONDS)
    first_byte_timeout: float = Field(60.0, gt=0, le=_MAX_SECONDS)
    idle_timeout: float = Field(
        60.0, gt=0, le=_MAX_SECONDS, description="seconds between two chunks of a stream"
    )
    # bounded as a key's limits are: 10**400 passed and then each request's float arithmetic raised
    rpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    tpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    max_parallel_requests: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    max_connections: int = Field(256, ge=1)
    weight: float = Field(1.0, gt=0)
    input_cost_per_token: float = Field(0.0, ge=0)
    output_cost_per_token: float = Field(0.0, ge=0)
    # a Batch API batch's tokens (LiteLLM's names); None: the prices above
    input_cost_per_token_batches: float | None = Field(None, ge=0)
    output_cost_per_token_batches: float | None = Field(None, ge=0)
    max_context: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    tokenizer: Literal["auto", "kvserve", "estimate"] = "auto"
    prefill_url: str | None = Field(
        None,
        description="pd deployment: each request's prompt first goes to this kv_producer (kvserve serve "
        "--kv-transfer-config), then to base_url, a kv_consumer, with the KV's whereabouts",
    )

    @field_validator("base_url", "prefill_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not re.match(r"^https?://", v):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


class Deployment(_Strict):
    model_name: str
    id: str | None = None
    backend: Backend


RoutingName = Literal[
    "simple-shuffle", "least-busy", "latency-based", "round-robin", "least-loaded", "session", "cache-aware"
]  # kvserve/routing/registry.py


class Degradation(_Strict):
    """What an alias does when its group's saturation (the backends' `kvserve:saturation`,
    polled) reaches `threshold`: send `share` of its requests to the `fallback` alias (a
    smaller model), or shed requests whose `priority` is `shed_priority` or more (higher
    numbers run later in kvserve, so they are the least urgent) with 503 + Retry-After."""

    threshold: float = Field(gt=0, description="group saturation at which degradation starts")
    action: Literal["fallback", "shed"]
    fallback: str | None = None
    share: float = Field(1.0, gt=0, le=1, description="fallback: share of requests sent there")
    shed_priority: int = Field(1, description="shed: requests with priority >= this are refused")
    retry_after: int = Field(5, ge=1, description="shed: the Retry-After seconds")


class GroupAlias(_Strict):
    """LiteLLM's model_group_alias entry: another name clients may send for a model group."""

    model: str = Field(description="the model_name (group) it names")
    hidden: bool = Field(False, description="left out of GET /v1/models (still callable)")


class RouterSettings(_Strict):
    routing_strategy: Literal[
        "simple-shuffle",
        "least-busy",
        "latency-based",
        "round-robin",
        "least-loaded",
        "session",
        "cache-aware",
    ] = "simple-shuffle"
    # cache-aware: ignore the cache when loads (estimated tokens) differ by more than abs AND rel x
    balance_abs_threshold: float = Field(2048, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    num_retries: int = Field(2, ge=0, le=20)
    retry_backoff_base: float = Field(0.1, ge=0)
    retry_backoff_cap: float = Field(5.0, ge=0)
    allowed_fails: int = Field(3, ge=1)
    cooldown_time: float = Field(30.0, ge=0, le=_MAX_SECONDS)  # (milliseconds Redis can take)
    fallbacks: dict[str, list[str]] = Field(default_factory=dict)
    # LiteLLM's {name: model_name} or {name: {model, hidden}}: a request naming `name` is served by
    # that group (one hop), as LiteLLM's router resolves it; a LiteLLM config's was refused
    model_group_alias: dict[str, GroupAlias] = Field(default_factory=dict)
    context_window_fallbacks: dict[str, list[str]] = Field(default_factory=dict)
    degradation: dict[str, Degradation] = Field(default_factory=dict)
    saturation_poll_interval: float = Field(1.0, gt=0, description="seconds between /metrics polls")

    @field_validator("fallbacks", "context_window_fallbacks", mode="before")
    @classmethod
    def _litellm_form(cls, v: object) -> object:
        """LiteLLM's form, a list of one-alias maps (`[{smol: [hosted]}]`), read as the map it
        means: a LiteLLM config's router_settings were refused at start ("a valid dictionary")."""
        if not isinstance(v, list) or not all(isinstance(d, dict) for d in v):
            return v
        merged: dict = {}
        for d in v:
            for alias, targets in d.items():
                if alias in merged:
                    raise ValueError(f"{alias!r} is given twice")
                merged[alias] = targets
        return merged

    @field_validator("model_group_alias", mode="before")
    @classmethod
    def _alias_as_text(cls, v: object) -> object:
        """LiteLLM's short form, `name: group`, is `{model: group}`."""
        if isinstance(v, dict):
            return {k: {"model": t} if isinstance(t, str) else t for k, t in v.items()}
        return v

    @model_validator(mode="after")
    def _thresholds_for_cache_aware(self) -> RouterSettings:
        """The balance thresholds, set with another strategy, were dropped without a word."""
        given = sorted({"balance_abs_threshold", "balance_rel_threshold"} & self.model_fields_set)
        if given and self.routing_strategy != "cache-aware":
            raise ValueError(
                f"{given[0]}: applies only to routing_strategy 'cache-aware', not {self.routing_strategy!r}; "
                "remove it or set routing_strategy: cache-aware"
            )
        return self


class ModelBudget(_Strict):
    """One model's budget on a key (LiteLLM's model_max_budget entry: budget_limit, time_period;
    its other spellings max_budget, budget_duration are taken too). No time_period: never resets."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    budget_limit: float = Field(
        ge=0, allow_inf_nan=False, validation_alias=AliasChoices("budget_limit", "max_budget")
    )
    time_period: str | None = Field(None, validation_alias=AliasChoices("time_period", "budget_duration"))

    _duration = field_validator("time_period")(lambda v: _checked_duration(v))


class ModelLimits(Limits):
    """LiteLLM's per-model limits, by model name (a group or a model_group_alias): model_limits.py.
    Keys and teams take all three (a user model_max_budget alone: UserSpec)."""

    model_max_budget: dict[str, ModelBudget] | None = None
    model_rpm_limit: dict[str, int] | None = None
    model_tpm_limit: dict[str, int] | None = None

    @field_validator("model_rpm_limit", "model_tpm_limit")
    @classmethod
    def _per_model(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        for name, n in (v or {}).items():
            storable_text(name)
            if isinstance(n, bool) or not 1 <= n <= _MAX_LIMIT:
                raise ValueError(f"{name}: a limit from 1 to {_MAX_LIMIT}")
        return v or None


class KeySpec(ModelLimits):
    key: str | None = None
    key_hash: str | None = None
    alias: str | None = None
    models: list[str] | None = None
    team: str | None = None
    metadata: dict | None = None  # the owner's notes (LiteLLM's key metadata), kept and shown
    expires: float | None = Field(None, allow_inf_nan=False, description="Unix seconds; refused after")
    # LiteLLM's /key/block: refused (401) until unblocked; None when not (stored specs stay as they were)
    blocked: bool | None = None
    # set by /key/regenerate only: the hash of the first key of this line, whose budget, limits
    # and spend log rows the regenerated key goes on with (as LiteLLM rotates a key in place)
    account: str | None = None
    # LiteLLM's user_id: the user (users.py) whose budget and limits cap this key too
    user: str | None = None

    @field_validator("blocked")
    @classmethod
    def _blocked(cls, v: bool | None) -> bool | None:
        return True if v else None  # (False is the default: not written into a stored spec)

    @field_validator("alias", "team", "models", "user")
    @classmethod
    def _text(cls, v: str | list[str] | None) -> str | list[str] | None:
        return storable_text(v)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict | None) -> dict | None:
        return storable_metadata(v)


def storable_metadata(v: dict | None) -> dict | None:
    """Metadata that can be stored: a lone surrogate in a key or value was a 500 and a
    traceback when the key was written (the client's mistake, told as a 400)."""
    try:
        json.dumps(v, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("not valid text (an unpaired surrogate)") from None
    return v


def storable_text(v: str | list[str] | None) -> str | list[str] | None:
    """Text that can be stored (UTF-8): a lone surrogate ("\\ud800") is valid JSON but not."""
    for t in [v] if isinstance(v, str) else v or []:
        try:
            t.encode()
        except UnicodeEncodeError:
            raise ValueError("not valid text (an unpaired surrogate)") from None
    return v


class TeamSpec(ModelLimits):
    models: list[str] | None = None


class UserSpec(Limits):
    """A user made through LiteLLM's /user/new (users.py): its budget and limits cap all its keys."""

    user_email: str | None = None
    user_alias: str | None = None
    # LiteLLM's roles for an ordinary user (its admin roles: the master key here); shown, not enforced
    user_role: Literal["internal_user", "internal_user_viewer", "customer"] | None = None
    models: list[str] | None = None
    metadata: dict | None = None
    # LiteLLM's per-model budgets of a user, over all its keys (model_limits.py)
    model_max_budget: dict[str, ModelBudget] | None = None

    @field_validator("user_email", "user_alias", "models")
    @classmethod
    def _text(cls, v: str | list[str] | None) -> str | list[str] | None:
        return storable_text(v)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict | None) -> dict | None:
        return storable_metadata(v)


class GeneralSettings(_Strict):
    master_key: str | None = None
    state: str = "memory"
    database: str = "kvserve_gateway.db"
    reservation_ttl: float | None = Field(
        None, gt=0, le=_MAX_SECONDS, description="default: longest timeout + 30 s"
    )
    shutdown_timeout: float = Field(30.0, ge=0, description="SIGTERM: seconds in-flight requests may finish")
    max_request_bytes: int = Field(
        16 * 2**20, ge=1024, description="a larger body is refused (413) before it is read into memory"
    )
    # browser pages on these origins may call the gateway (CORS; "*": any), as `kvserve serve
    # --allowed-origins`; none by default. Without it a web app's preflight was a 405, always
    allowed_origins: list[str] = Field(default_factory=list)

    @field_validator("state")
    @classmethod
    def _state(cls, v: str) -> str:
        return _store_url(v)


class SemanticCache(_Strict):
    """Opt-in: a request whose whole conversation embeds within `threshold` (cosine) of a
    cached one's, with the same non-text parameters and the same negations and numbers, gets
    that answer (kvserve/gateway/cache_keys.py says why the guard)."""

    embedding_model: str = Field(description="model_name whose backends serve /v1/embeddings")
    models: list[str] | None = Field(None, description="model_names matched semantically (None: all cached)")
    threshold: float = Field(0.95, gt=0, le=1)
    max_entries: int = Field(256, ge=1, description="conversations compared per parameter set")
    pooling: Literal["last", "mean"] | None = Field(None, description="kvserve backends: the pooling")


class ResponseCache(_Strict):
    """Exact-match response cache, shared by N gateways through Redis. `store` gives it a Redis
    of its own: large answers with TTLs in the state store's Redis made it evict rate-limit
    windows (which have TTLs too) under maxmemory, silently resetting limits."""

    store: str | None = Field(None, description="'memory' or a redis:// URL (default: the state store)")
    max_bytes: int = Field(
        256 * 2**20,
        ge=1,
        description="a memory store's answers and semantic buckets at most (least recently used go); "
        "Redis: its maxmemory",
    )
    ttl: float = Field(600.0, gt=0, le=_MAX_SECONDS, description="seconds an answer is kept")
    models: list[str] | None = Field(None, description="model_names cached (None: all)")
    any_temperature: bool = Field(False, description="also cache requests with temperature > 0")
    semantic: SemanticCache | None = None

    @field_validator("store")
    @classmethod
    def _store(cls, v: str | None) -> str | None:
        return v if v is None else _store_url(v)


class GatewayConfig(_Strict):
    model_list: list[Deployment] = Field(min_length=1)
    router_settings: RouterSettings = Field(default_factory=RouterSettings)
    keys: list[KeySpec] = Field(default_factory=list)
    teams: dict[str, TeamSpec] = Field(default_factory=dict)
    general_settings: GeneralSettings = Field(default_factory=GeneralSettings)
    response_cache: ResponseCache | None = None

    def aliases(self) -> list[str]:
        return list(dict.fromkeys(d.model_name for d in self.model_list))

    def names(self) -> list[str]:
        """What a request's `model` may say: the groups, then router_settings.model_group_alias's."""
        return [*self.aliases(), *self.router_settings.model_group_alias]

    def group_of(self, name: str) -> str:
        """The group a name is served by (itself, unless a model_group_alias)."""
        entry = self.router_settings.model_group_alias.get(name)
        return entry.model if entry is not None else name

    def permits(self, restriction: list[str] | None, name: str) -> bool:
        """A key's or team's `models` let a name through when they list it or the group it names."""
        return restriction is None or name in restriction or self.group_of(name) in restriction


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "mo": 30 * 86400}
# LiteLLM's words for a budget_duration (its docs and UI write them)
_WORDS = {"hourly": "1h", "daily": "1d", "weekly": "1w", "monthly": "1mo"}


def _checked_duration(v: str | None) -> str | None:
    """A budget period as given, once it parses (a config or API value that does not is refused)."""
    if v is not None:
        parse_duration(v)
    return v


def parse_duration(text: str) -> float:
    """'30s', '10m', '24h', '30d', and LiteLLM's '1w', '1mo', 'daily', ... -> seconds. `1mo` is
    `30d`, which a budget counts in calendar months (state/base.py), as LiteLLM resets `1mo` on
    the 1st; whole weeks reset on Mondays. More months than one (LiteLLM's `2mo`) have no such
    period here: refused, not counted as 60 days from 1970."""
    t = _WORDS.get(text.strip().lower(), text.strip())
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(mo|[smhdw])", t)
    if not m or float(m.group(1)) <= 0 or (m.group(2) == "mo" and float(m.group(1)) != 1):
        raise ValueError(f"{text!r} is not a duration like 30s, 10m, 24h, 30d, 1w or 1mo")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _check_references(cfg: GatewayConfig) -> None:
    aliases = set(cfg.aliases())
    rs = cfg.router_settings
    for field in ("fallbacks", "context_window_fallbacks"):
        for alias, targets in getattr(rs, field).items():
            for t in [alias, *targets]:
                if t not in aliases:
                    raise ConfigError(f"router_settings.{field}.{alias}: unknown model_name {t!r}")
    for alias, deg in rs.degradation.items():
        where = f"router_settings.degradation.{alias}"
        if alias not in aliases:
            raise ConfigError(f"{where}: unknown model_name {alias!r}")
        if deg.action == "fallback" and deg.fallback is None:
            raise ConfigError(f"{where}.fallback: required with action 'fallback'")
        if deg.fallback is not None and deg.fallback not in aliases:
            raise ConfigError(f"{where}.fallback: unknown model_name {deg.fallback!r}")
        if deg.fallback == alias:
            raise ConfigError(f"{where}.fallback: must be another model_name than {alias!r}")
    names = set(cfg.names())
    owners = [(f"teams.{t}", s) for t, s in cfg.teams.items()] + [
        (f"keys.{i}", k) for i, k in enumerate(cfg.keys)
    ]
    for where, spec in owners:  # (a per-model limit on no model served caps nothing)
        for field in ("model_max_budget", "model_rpm_limit", "model_tpm_limit"):
            for model in getattr(spec, field) or {}:
                if model not in names:
                    raise ConfigError(f"{where}.{field}.{model}: unknown model_name {model!r}")
    for name, entry in rs.model_group_alias.items():
        where = f"router_settings.model_group_alias.{name}"
        if name in aliases:  # (which one would a request mean?)
            raise ConfigError(f"{where}: {name!r} is a model_name already; an alias must be another name")
        if entry.model not in aliases:  # (one hop, as LiteLLM's router: an alias of an alias is unknown)
            raise ConfigError(f"{where}.model: unknown model_name {entry.model!r}")
    names = set(cfg.names())
    rc = cfg.response_cache
    for m in (rc.models or []) if rc else []:
        if m not in aliases:
            raise ConfigError(f"response_cache.models: unknown model_name {m!r}")
    for m in (rc.semantic.models or []) if rc and rc.semantic else []:
        if m not in aliases:
            raise ConfigError(f"response_cache.semantic.models: unknown model_name {m!r}")
    if rc and rc.semantic and rc.semantic.embedding_model not in aliases:
        raise ConfigError(
            f"response_cache.semantic.embedding_model: unknown model_name {rc.semantic.embedding_model!r}"
        )
    ids: set[str] = set()
    for i, d in enumerate(cfg.model_list):
        d.id = d.id or f"{d.model_name}-{i}"
        if d.id in ids:
            raise ConfigError(f"model_list.{i}.id: duplicate deployment id {d.id!r}")
        ids.add(d.id)
        d.backend.api_key = _secret(d.backend.api_key, f"model_list.{i}.backend.api_key")
    for name, team in cfg.teams.items():
        for m in team.models or []:
            if m not in names:
                raise ConfigError(f"teams.{name}.models: unknown model_name {m!r}")
    for i, k in enumerate(cfg.keys):
        if (k.key is None) == (k.key_hash is None):
            raise ConfigError(f"keys.{i}: give exactly one of key or key_hash")
        k.key = _secret(k.key, f"keys.{i}.key")
        if k.account is not None:
            raise ConfigError(f"keys.{i}.account: set by /key/regenerate only")
        if k.team is not None and k.team not in cfg.teams:
            raise ConfigError(f"keys.{i}.team: unknown team {k.team!r}")
        for m in k.models or []:
            if m not in names:
                raise ConfigError(f"keys.{i}.models: unknown model_name {m!r}")
    gs = cfg.general_settings
    gs.master_key = _secret(gs.master_key, "general_settings.master_key")
    _check_key_hashes(cfg)


def _check_key_hashes(cfg: GatewayConfig) -> None:
    """A key_hash that is no SHA-256, or a key given twice (or equal to the master key), would
    load silently and then never match or never apply: the first entry or the master wins."""
    seen: dict[str, str] = {}
    master = cfg.general_settings.master_key
    if master:
        seen[hashlib.sha256(master.encode()).hexdigest()] = "general_settings.master_key"
    for i, k in enumerate(cfg.keys):
        if k.key_hash is not None:
            if not re.fullmatch(r"[0-9a-fA-F]{64}", k.key_hash):
                raise ConfigError(f"keys.{i}.key_hash: not a SHA-256 (64 hex digits) of a key")
            k.key_hash = k.key_hash.lower()  # as hash_key writes it
        h = k.key_hash or hashlib.sha256((k.key or "").encode()).hexdigest()
        if h in seen:
            raise ConfigError(f"keys.{i}: the same key as {seen[h]}")
        seen[h] = f"keys.{i}"


def parse_config(data: object) -> GatewayConfig:
    """Validate an already-loaded YAML document."""
    if not isinstance(data, dict):
        raise ConfigError("(top level): expected a mapping with model_list, router_settings, ...")
    try:
        cfg = GatewayConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(f"{_loc(err['loc'])}: {msg}") from None
    _check_references(cfg)
    return cfg


def load_config(path: str) -> GatewayConfig:
    """Read and validate a gateway YAML file; raises ConfigError with a one-line message."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    return parse_config(data)
