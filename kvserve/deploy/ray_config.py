"""The `kvserve deploy ray --config FILE` document: pydantic models, YAML loading, and one-line
errors that name the key ("autoscaling.max_replicas: ..."). Read before Ray is imported, so
a typo costs no cluster start."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvserve.config import EngineConfig
from kvserve.routing.registry import STRATEGIES


class DeployConfigError(ValueError):
    """A configuration problem; str() is one line: 'key.path: problem'."""


class _Strict(BaseModel):
    # (inf and nan are floats too: `.inf` passed every gt=0 bound and reached Serve and the router)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # kvserve serve's --max-request-bytes default


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # the front reads a body whole before a replica sees it: without a bound one upload takes its
    # memory. Unset: the replicas' --max-request-bytes (RayDeployConfig.max_request_bytes)
    max_request_bytes: int | None = Field(None, ge=1, description="a larger body is a 413 at the front")


class ReplicaConfig(_Strict):
    """One kvserve replica: a `kvserve serve` process owned by a Serve replica actor."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    threads: int | None = Field(None, ge=1, description="OMP_NUM_THREADS of the server (default: Ray's)")
    max_ongoing_requests: int = Field(16, ge=1, description="Serve's cap of requests in one replica")
    startup_timeout_s: float = Field(900.0, gt=0, description="model load + warm-up before failing")
    # Serve's drain on scale-down: stop routing, wait for ongoing requests (checked every
    # wait_loop_s) up to timeout_s, then our destructor SIGTERMs the server (its own drain).
    graceful_shutdown_timeout_s: float = Field(120.0, gt=0)
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0)
    server_shutdown_timeout_s: float = Field(30.0, gt=0, description="the server's --shutdown-timeout")


class AutoscalingConfig(_Strict):
    """Serve's autoscaling_config, with the keys it takes (their meaning is Serve's)."""

    min_replicas: int = Field(1, ge=1, description="no scale to zero: a model load takes minutes")
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    metrics_interval_s: float = Field(2.0, gt=0)
    look_back_period_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self


class RoutingConfig(_Strict):
    """Which kvserve routing policy picks the replica (kvserve/routing; cache-aware matches
    prompt text, as the gateway does, since the router does not tokenize)."""

    policy: str = "cache-aware"
    cache_aware: dict[str, float] = Field(default_factory=dict, description="CacheAware's thresholds")

    @field_validator("policy")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in STRATEGIES:
            raise ValueError(f"{v!r} is not one of {', '.join(STRATEGIES)}")
        return v

    @field_validator("cache_aware")
    @classmethod
    def _thresholds(cls, v: dict[str, float]) -> dict[str, float]:
        for key, value in v.items():
            if key not in _THRESHOLDS:
                raise ValueError(f"{key!r} is not one of {', '.join(_THRESHOLDS)}")
            low, high, strict = _THRESHOLDS[key]
            if value < low or (strict and value == low) or (high is not None and value > high):
                bound = f"{'>' if strict else '>='} {low:g}"
                bound += f" and <= {high:g}" if high is not None else ""
                raise ValueError(f"{key}: must be {bound}, got {value:g}")
        return v

    @model_validator(mode="after")
    def _only_for_cache_aware(self) -> RoutingConfig:
        """Thresholds with another policy were dropped without a word: the operator believed
        them in force."""
        if self.cache_aware and self.policy != "cache-aware":
            raise ValueError(
                f"cache_aware: thresholds apply only to policy 'cache-aware', not {self.policy!r}; "
                "remove them or set policy: cache-aware"
            )
        return self


# CacheAware's thresholds: (lowest, highest or None, lowest excluded). A recent_work_tau of 0
# divided by zero in every routing decision after the first: each request failed in the router.
_THRESHOLDS = {
    "balance_abs_threshold": (0, None, False),
    "balance_rel_threshold": (1, None, False),
    "load_weight": (0, None, False),
    "cache_threshold": (0, 1, False),
    "recent_work_tau": (0, None, True),
    "recent_abs_threshold": (0, None, False),
}


_AnyFloat = Annotated[float, Field(allow_inf_nan=True)]  # engine values: checked one by one below
_ENGINE_FIELDS = {f.name: f for f in fields(EngineConfig) if f.name != "model"}


class RayDeployConfig(_Strict):
    model: str = "smollm2-135m"
    app_name: str = "kvserve"
    route_prefix: str = "/"
    address: str | None = Field(None, description="Ray address; --address overrides")
    served_model_name: list[str] | None = None
    engine: dict[str, str | int | _AnyFloat | bool] = Field(
        default_factory=dict, description="EngineConfig fields, as `kvserve serve` flags without --"
    )
    server_args: list[str] = Field(default_factory=list, description="more `kvserve serve` flags, verbatim")
    http: HttpConfig = Field(default_factory=HttpConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)

    @field_validator("engine")
    @classmethod
    def _engine_keys(cls, v: dict) -> dict:
        for key in v:
            if key.replace("-", "_") not in _ENGINE_FIELDS:
                raise ValueError(f"{key!r} is not an engine setting (see `kvserve serve --help`)")
        return {k.replace("-", "_"): val for k, val in v.items()}

    @field_validator("server_args")
    @classmethod
    def _not_owned(cls, v: list[str]) -> list[str]:
        """--host and --port are the replica's own (it polls the server there): given again here
        they won (the last flag counts), and every replica waited out startup_timeout_s."""
        for arg in v:
            flag = arg.split("=", 1)[0]
            if flag in ("--host", "--port"):
                raise ValueError(f"{flag} is set by each replica (it picks a free local port)")
        return v

    @property
    def max_request_bytes(self) -> int:
        """The body limit of the front and of every replica: http.max_request_bytes, else the
        replicas' --max-request-bytes in server_args, else kvserve serve's default."""
        given = self.http.max_request_bytes or _replica_body_limit(self.server_args)
        return given or DEFAULT_MAX_REQUEST_BYTES

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must start with '/'")
        return v

    def server_argv(self, port: int) -> list[str]:
        """`kvserve serve` arguments for one replica on 127.0.0.1:port."""
        argv = ["serve", self.model, "--host", "127.0.0.1", "--port", str(port), "--disable-web-ui",
                "--shutdown-timeout", str(self.replica.server_shutdown_timeout_s)]  # fmt: skip
        if self.served_model_name:
            argv += ["--served-model-name", *self.served_model_name]
        for key, value in self.engine.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
        if self.http.max_request_bytes is not None and _replica_body_limit(self.server_args) is None:
            argv += ["--max-request-bytes", str(self.http.max_request_bytes)]  # (what the front passes)
        return argv + self.server_args


def _replica_body_limit(server_args: list[str]) -> int | None:
    """--max-request-bytes as the replicas' `kvserve serve` reads it from server_args (the last
    one counts, `--flag N` or `--flag=N`); None when absent or not a positive integer (serve's
    parser refuses that before Ray starts: deploy/cli.py)."""
    found = None
    for i, arg in enumerate(server_args):
        flag, eq, value = arg.partition("=")
        if flag != "--max-request-bytes":
            continue
        value = value if eq else (server_args[i + 1] if i + 1 < len(server_args) else "")
        found = int(value) if value.isdigit() and int(value) > 0 else None
    return found


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_config(data: object) -> RayDeployConfig:
    """Validate a loaded YAML document; DeployConfigError names the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise DeployConfigError("(top level): expected a mapping with model, autoscaling, replica, ...")
    try:
        cfg = RayDeployConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise DeployConfigError(f"{_loc(err['loc'])}: {msg}") from None
    _check_engine_values(cfg)
    _check_body_limit(cfg)
    return cfg


def _check_body_limit(cfg: RayDeployConfig) -> None:
    """The front's limit and the replicas' are one setting: set apart, the smaller one silently
    decided (a replica's --max-request-bytes raised alone still met the front's 16 MiB 413)."""
    front, replicas = cfg.http.max_request_bytes, _replica_body_limit(cfg.server_args)
    if front is not None and replicas is not None and front != replicas:
        raise DeployConfigError(
            f"http.max_request_bytes: {front} differs from server_args' --max-request-bytes {replicas}; "
            "set one of them (it is the front's limit and the replicas')"
        )


def _check_engine_values(cfg: RayDeployConfig) -> None:
    """The engine values too, as the replicas' `kvserve serve` will read them: a bad one
    (max_num_seqs: many, kv_cache_memory: lots) passed here and then failed every replica's start."""
    kwargs = {}
    for key, value in cfg.engine.items():
        typ = str(_ENGINE_FIELDS[key].type).split(" |")[0]
        if isinstance(value, float) and not math.isfinite(value):  # (int(.inf) raised OverflowError)
            raise DeployConfigError(f"engine.{key}: {value!r} is not a finite number")
        if (typ == "bool") != isinstance(value, bool):
            raise DeployConfigError(f"engine.{key}: {value!r} is not a valid {typ}")
        try:
            kwargs[key] = {"int": int, "float": float}.get(typ, lambda v: v)(value)
        except (TypeError, ValueError):
            raise DeployConfigError(f"engine.{key}: {value!r} is not a valid {typ}") from None
        if typ == "int" and isinstance(value, float) and kwargs[key] != value:
            raise DeployConfigError(f"engine.{key}: {value!r} is not a valid int")
    try:
        EngineConfig(model=cfg.model, **kwargs)  # checks the values only; the model is not opened
    except (TypeError, ValueError) as e:  # its messages start with the field's name
        raise DeployConfigError(f"engine.{e}") from None


def load_config(path: str) -> RayDeployConfig:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise DeployConfigError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise DeployConfigError(f"{path}:{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    return parse_config(data)
