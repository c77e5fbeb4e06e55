"""Runs one harness attempt as a Kubernetes Job (the official `kubernetes` client): one Job per rollout, watched to
its end, its pod's log and outcome read back, deleted on cancel.

Inside the pod a small POSIX-sh wrapper (WRAPPER) writes the task file from LIGHTNING_TASK_JSON, runs the harness's
argv, then hands the output file back twice: as the container's termination message when it fits in 4096 bytes,
and as the last log line `LIGHTNING_OUTCOME <the file, line breaks dropped>`. The image needs /bin/sh."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import urllib3
from django.conf import settings
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from sandbox.executors.base import PLACEHOLDERS, TAIL_BYTES, Attempt, ExecutorSetupError, Outcome, parse_outcome

logger = logging.getLogger(__name__)

CONTAINER = "harness"
ROOT = "/lightning"  # an emptyDir: writable whatever user the image runs as
TERMINATION_LOG = "/dev/termination-log"
MARKER = "LIGHTNING_OUTCOME"
MAX_TASK_BYTES = 120 * 1024
"""The task travels in one environment variable, and Linux takes no single variable over 128 KiB."""
API_TIMEOUT_S = 30.0
"""Connect and read timeout of each API call (a watch reads for WATCH_S + WATCH_SLACK_S)."""
WATCH_S = 30
"""A watch asks the server to end after this long; between watches the executor re-reads the Job and checks
whether its pod is stuck (an image that cannot be pulled)."""
WATCH_SLACK_S = 10.0
GRACE_S = 120.0
"""How long past the harness timeout the executor waits for Kubernetes to report the Job's end (the Job's own
activeDeadlineSeconds ends it) before it gives up and deletes the Job."""
API_RETRIES = 5
"""Consecutive failed API calls while watching before the attempt fails (infrastructure); backoff 2, 4, 8 ... s."""
LOG_TAIL_LINES = 2000
LOG_MAX_BYTES = 16 * 1024 * 1024
THREADS = 64
"""The client is blocking: each attempt holds a thread of the executor's own pool while it watches its Job."""
STUCK = {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
"""Waiting reasons of a harness container that will not start however long the Job waits."""
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)
"""An API call that failed: refused, unreachable, timed out, or answered with something that is not JSON."""
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ANY_ADDRESS = {"0.0.0.0", "::", ""}

WRAPPER = r"""
mkdir -p "$LIGHTNING_WORKDIR" && cd "$LIGHTNING_WORKDIR" || exit 125
printf '%s' "$LIGHTNING_TASK_JSON" > "$LIGHTNING_TASK_FILE" || exit 125
unset LIGHTNING_TASK_JSON
child=
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
"$@" &
child=$!
wait "$child"
code=$?
while kill -0 "$child" 2>/dev/null; do wait "$child"; code=$?; done
if [ -f "$LIGHTNING_OUTPUT_FILE" ]; then
  if [ "$(wc -c < "$LIGHTNING_OUTPUT_FILE")" -le 4096 ]; then
    cat "$LIGHTNING_OUTPUT_FILE" > "$LIGHTNING_TERMINATION_LOG"
  fi
  printf '\nLIGHTNING_OUTCOME %s\n' "$(head -c 10485760 "$LIGHTNING_OUTPUT_FILE" | tr -d '\r\n')"
fi
exit "$code"
"""
"""The container's command (`sh -c WRAPPER lightning-harness <argv>`): the harness runs as a child so a SIGTERM at
the deadline reaches it and its output file is still handed back. The kubelet keeps 4096 bytes of a termination
message; a larger output comes back (up to 10 MiB) on the marker line only."""


def api_client() -> client.ApiClient:
    """A client on the cluster LIGHTNING_K8S_KUBECONFIG names, else the in-cluster service account, else
    ~/.kube/config (or $KUBECONFIG)."""
    configuration = client.Configuration()
    if settings.LIGHTNING_K8S_KUBECONFIG:
        config.load_kube_config(config_file=settings.LIGHTNING_K8S_KUBECONFIG, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = THREADS
    return client.ApiClient(configuration)


def pod_base_url(local: str) -> str:
    """The rollout's base URL as pods reach the proxy: LIGHTNING_PROXY_ADVERTISE_URL (its scheme, host, port and
    path prefix; `{port}` in it stands for the proxy's own port) in front of the rollout's path."""
    advertise = settings.LIGHTNING_PROXY_ADVERTISE_URL
    if not advertise:
        return local
    ours = urlsplit(local)
    theirs = urlsplit(advertise.replace("{port}", str(ours.port)).rstrip("/"))
    return urlunsplit((theirs.scheme, theirs.netloc, theirs.path + ours.path, "", ""))


def check_proxy_reachable() -> None:
    """ExecutorSetupError unless pods can reach this worker's proxy."""
    host, advertise = settings.LIGHTNING_PROXY_HOST, settings.LIGHTNING_PROXY_ADVERTISE_URL
    if host in LOOPBACK:
        raise ExecutorSetupError(
            f"a kubernetes harness cannot reach the proxy listening on {host}: set LIGHTNING_PROXY_HOST=0.0.0.0 and "
            "LIGHTNING_PROXY_ADVERTISE_URL to the address pods reach it at (e.g. http://lightning-proxy.<ns>.svc:8100)")
    if not advertise and host in ANY_ADDRESS:
        raise ExecutorSetupError(
            "a kubernetes harness needs the proxy's address as pods see it: set LIGHTNING_PROXY_ADVERTISE_URL "
            "(e.g. http://lightning-proxy.<ns>.svc:8100)")


def container_resources(resources: dict[str, Any]) -> dict[str, dict[str, str]]:
    """requests and limits of the harness container from its harness's resources (cpu, memory, gpu)."""
    sized = {key: str(resources[key]) for key in ("cpu", "memory") if resources.get(key) not in (None, "")}
    limits = dict(sized)
    if resources.get("gpu"):
        limits["nvidia.com/gpu"] = str(int(resources["gpu"]))
    return {"requests": sized, "limits": limits} if limits else {}


def job_name(attempt: Attempt) -> str:
    return f"lw-{attempt.run_id or 'run'}-{attempt.rollout_id}-{secrets.token_hex(3)}"[:63].lower()


class KubernetesExecutor:
    """One Job per attempt in LIGHTNING_K8S_NAMESPACE; the harness container runs `image` with its argv."""

    def __init__(self, image: str, resources: dict[str, Any] | None = None):
        if not image:
            raise ExecutorSetupError("a kubernetes harness needs a container image")
        check_proxy_reachable()
        try:
            api = api_client()
        except (config.ConfigException, OSError, ValueError) as exc:
            raise ExecutorSetupError(f"no Kubernetes cluster to run harness jobs on ({exc}): set "
                                     "LIGHTNING_K8S_KUBECONFIG or run the worker inside the cluster") from exc
        self.image, self.resources = image, dict(resources or {})
        self.namespace = settings.LIGHTNING_K8S_NAMESPACE
        self.ttl_s = settings.LIGHTNING_K8S_JOB_TTL_S
        self.batch, self.core = client.BatchV1Api(api), client.CoreV1Api(api)
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ the attempt

    async def run(self, attempt: Attempt) -> Outcome:
        started, name = time.monotonic(), job_name(attempt)
        try:
            body = self.job_body(attempt, name)
        except (ValueError, KeyError, IndexError) as exc:
            return Outcome(None, False, "", "", error=f"harness job not created: {exc}")
        create = asyncio.ensure_future(self._call(self.batch.create_namespaced_job, self.namespace, body,
                                                  _request_timeout=API_TIMEOUT_S))
        create.add_done_callback(lambda done: done.cancelled() or done.exception())  # read below, or by a cancel
        try:
            await asyncio.shield(create)
        except asyncio.CancelledError:  # let the create land (or fail), then take the Job back
            await asyncio.wait([create])
            await asyncio.shield(self._call(self._delete_quietly, name))
            raise
        except API_ERRORS as exc:
            if not (isinstance(exc, ApiException) and exc.status and exc.status < 500):
                await self._call(self._delete_quietly, name)  # the server may have created it before it failed
            return Outcome(None, False, "", "", seconds=time.monotonic() - started,
                           error=f"kubernetes did not create the harness job: {describe(exc)}")
        logger.info("rollout %s: harness job %s/%s created", attempt.rollout_id, self.namespace, name)
        stop = threading.Event()
        try:
            verdict, detail = await self._call(self._wait, name, started + attempt.timeout_s + GRACE_S, stop)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.shield(self._call(self._delete_quietly, name))
            raise
        except API_ERRORS as exc:
            await self._call(self._delete_quietly, name)
            return Outcome(None, False, "", "", seconds=time.monotonic() - started,
                           error=f"lost the kubernetes API while the harness job ran: {describe(exc)}")
        seconds = time.monotonic() - started
        try:
            return await self._call(self._result, attempt, name, verdict, detail, seconds)
        finally:
            if verdict != "finished" or not self.ttl_s:
                await asyncio.shield(self._call(self._delete_quietly, name))

    def job_body(self, attempt: Attempt, name: str) -> dict[str, Any]:
        """The Job as the API receives it; ValueError where the task is too large to pass."""
        task_json = json.dumps(attempt.task)
        if len(task_json.encode()) > MAX_TASK_BYTES:
            raise ValueError(f"the task is {len(task_json.encode())} bytes as JSON: a kubernetes harness takes tasks "
                             f"up to {MAX_TASK_BYTES // 1024} KiB (passed in an environment variable)")
        base_url = pod_base_url(attempt.base_url)
        values = {"task_file": f"{ROOT}/task.json", "output_file": f"{ROOT}/output.json", "task_id": attempt.task_id,
                  "workdir": f"{ROOT}/work", "base_url": base_url, "api_key": attempt.api_key,
                  "model": attempt.model, "rollout_id": attempt.rollout_id}
        assert values.keys() == PLACEHOLDERS.keys(), "PLACEHOLDERS names what the executor fills"
        argv = [arg.format(**values) for arg in attempt.command]
        env = {key: value.format(**values) for key, value in attempt.env.items()}
        env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=attempt.api_key,
                   ANTHROPIC_BASE_URL=base_url.removesuffix("/v1"), ANTHROPIC_API_KEY=attempt.api_key,
                   LIGHTNING_TASK_FILE=values["task_file"], LIGHTNING_OUTPUT_FILE=values["output_file"],
                   LIGHTNING_WORKDIR=values["workdir"], LIGHTNING_ROLLOUT_ID=attempt.rollout_id,
                   LIGHTNING_MODEL=attempt.model, LIGHTNING_TERMINATION_LOG=TERMINATION_LOG,
                   LIGHTNING_TASK_JSON=task_json)
        labels = {"app.kubernetes.io/managed-by": "lightning-web", "lightning/run": attempt.run_id,
                  "lightning/rollout": attempt.rollout_id,
                  "lightning/step": "" if attempt.step is None else str(attempt.step)}
        container = {"name": CONTAINER, "image": self.image, "command": ["/bin/sh", "-c", WRAPPER,
                                                                         "lightning-harness", *argv],
                     "env": [{"name": key, "value": value} for key, value in env.items()],
                     "volumeMounts": [{"name": "lightning", "mountPath": ROOT}],
                     "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "File"}
        if sized := container_resources(self.resources):
            container["resources"] = sized
        spec: dict[str, Any] = {
            "backoffLimit": 0, "activeDeadlineSeconds": max(1, math.ceil(attempt.timeout_s)),
            "template": {"metadata": {"labels": labels}, "spec": {
                "restartPolicy": "Never", "containers": [container], "volumes": [{"name": "lightning", "emptyDir": {}}],
                "automountServiceAccountToken": False, "enableServiceLinks": False}}}
        if self.ttl_s:
            spec["ttlSecondsAfterFinished"] = self.ttl_s
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": self.namespace, "labels": labels}, "spec": spec}

    # ------------------------------------------------------------------ blocking parts (the executor's threads)

    def _wait(self, name: str, deadline: float, stop: threading.Event) -> tuple[str, Any]:
        """Watch the Job until it ends: ("finished", job), ("deleted", None), ("stuck", (reason, message)) when
        its pod cannot start, ("late", None) past `deadline`, ("stopped", None) once `stop` is set."""
        failures = 0
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return "late", None
            try:
                job = self._read_job(name)  # what a watch that ended may have missed
                failures = 0
                if job is None:
                    return "deleted", None
                if job_end(job):
                    return "finished", job
                if stuck := stuck_reason(self._pod(name)):
                    return "stuck", stuck
                version = (job.get("metadata") or {}).get("resourceVersion")
                since = {"resource_version": version} if version else {}
                stream = watch.Watch().stream(
                    self.batch.list_namespaced_job, self.namespace, field_selector=f"metadata.name={name}",
                    timeout_seconds=max(1, int(min(WATCH_S, left))),
                    _request_timeout=(API_TIMEOUT_S, WATCH_S + WATCH_SLACK_S), **since)
                for event in stream:
                    job = event.get("raw_object") or {}
                    if (job.get("metadata") or {}).get("name") != name:
                        continue
                    if event.get("type") == "DELETED":
                        return "deleted", None
                    if job_end(job):
                        return "finished", job
                    if stop.is_set() or time.monotonic() > deadline:
                        break
            except urllib3.exceptions.ReadTimeoutError:
                continue  # a quiet watch outlived its read timeout: look again
            except API_ERRORS as exc:
                if isinstance(exc, ApiException) and exc.status == 410:
                    continue  # the version read is too old to watch from: read the Job again
                failures += 1
                if failures > API_RETRIES:
                    raise
                logger.warning("harness job %s: kubernetes API call failed (%s), retry %d", name, describe(exc),
                               failures)
                stop.wait(min(2.0 ** failures, 30.0))
        return "stopped", None

    def _result(self, attempt: Attempt, name: str, verdict: str, detail: Any, seconds: float) -> Outcome:
        try:
            pod = self._pod(name)
        except API_ERRORS as exc:  # judged on the Job alone
            logger.warning("harness job %s/%s: its pod could not be read: %s", self.namespace, name, describe(exc))
            pod = None
        log = self._log(pod) if pod else ""
        marked, stdout = split_marker(log)
        terminated = terminated_state(pod)
        code = terminated.get("exitCode") if terminated else None
        message = (terminated or {}).get("message") or ""
        timed_out = False
        if verdict == "deleted":
            code, error = None, "the harness job was deleted before it finished"
        elif verdict == "late":
            code, timed_out = None, True
            error = (f"kubernetes did not report the harness job's end within {attempt.timeout_s + GRACE_S:g} s "
                     "(its timeout and a grace); the job was deleted")
        elif verdict == "stuck":
            code, error = None, f"the harness pod could not start: {detail[0]}: {detail[1]}"
        elif verdict == "stopped":
            code, error = None, "the harness job was stopped"
        else:
            kind, reason, why = job_end(detail)
            if kind == "Complete":
                code = code or 0
                error = f"harness exited with code {code}" if code else ""
            elif reason == "DeadlineExceeded":
                timed_out, error = True, f"harness timed out after {attempt.timeout_s:g} s"
                if code is None and not never_started(pod):
                    code = -9  # killed at the deadline, as the local executor reports a timeout
            elif evicted := eviction(pod):
                code, error = None, f"the harness pod was evicted: {evicted}"
            elif code:
                oom = " (OOMKilled: it outgrew its memory limit)" if terminated.get("reason") == "OOMKilled" else ""
                error = f"harness exited with code {code}{oom}"
            else:
                code, error = None, f"the harness job failed ({reason}: {why})"
        text = message if message.strip() else marked
        outcome = parse_outcome(text, code, stdout) if code is not None else {}
        logger.info("rollout %s: harness job %s/%s ended: %s", attempt.rollout_id, self.namespace, name,
                    error or "succeeded")
        return Outcome(code, timed_out, stdout[-TAIL_BYTES:], "", outcome, seconds, error)

    def _read_job(self, name: str) -> dict | None:
        try:
            response = self.batch.read_namespaced_job(name, self.namespace, _preload_content=False,
                                                      _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(response.data)

    def _pod(self, name: str) -> dict | None:
        """The Job's latest pod, None when it has none (yet, or any more)."""
        try:
            response = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}",
                                                     _preload_content=False, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        pods = [pod for pod in json.loads(response.data).get("items") or []
                if ((pod.get("metadata") or {}).get("labels") or {}).get("job-name") == name]
        return max(pods, key=lambda pod: pod["metadata"].get("creationTimestamp") or "", default=None)

    def _log(self, pod: dict) -> str:
        name = pod["metadata"]["name"]
        try:
            response = self.core.read_namespaced_pod_log(
                name, self.namespace, container=CONTAINER, tail_lines=LOG_TAIL_LINES, limit_bytes=LOG_MAX_BYTES,
                _preload_content=False, _request_timeout=API_TIMEOUT_S)
            return response.data.decode("utf-8", "replace")
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            logger.warning("pod %s/%s: its log could not be read: %s", self.namespace, name, describe(exc))
            return ""

    def _delete_quietly(self, name: str) -> None:
        try:
            self.batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background",
                                             _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 404:
                logger.warning("harness job %s/%s could not be deleted: %s", self.namespace, name, describe(exc))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            logger.warning("harness job %s/%s could not be deleted: %s", self.namespace, name, describe(exc))

    async def _call(self, fn, *args, **kwargs):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="k8s-harness")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))


# ---------------------------------------------------------------------- reading Kubernetes objects


def job_end(job: dict) -> tuple[str, str, str] | None:
    """("Complete" | "Failed", reason, message) once the Job has ended, else None."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition["type"], condition.get("reason") or "", condition.get("message") or ""
    return None


def container_status(pod: dict | None) -> dict:
    for status in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER:
            return status
    return {}


def terminated_state(pod: dict | None) -> dict | None:
    status = container_status(pod)
    return (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated")


def never_started(pod: dict | None) -> bool:
    """The pod exists and its harness container never ran (still waiting: pulling, or unschedulable)."""
    if pod is None:
        return False
    status = container_status(pod)
    return not status or ("waiting" in (status.get("state") or {}) and not status.get("lastState"))


def stuck_reason(pod: dict | None) -> tuple[str, str] | None:
    waiting = (container_status(pod).get("state") or {}).get("waiting") or {}
    return (waiting["reason"], waiting.get("message") or "") if waiting.get("reason") in STUCK else None


def eviction(pod: dict | None) -> str:
    """Why the pod was evicted or disrupted (node pressure, preemption, drain), '' when it was not."""
    status = (pod or {}).get("status") or {}
    if status.get("reason") == "Evicted":
        return status.get("message") or "Evicted"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return f"{condition.get('reason') or 'disrupted'}: {condition.get('message') or ''}".rstrip(": ")
    return ""


def split_marker(log: str) -> tuple[str | None, str]:
    """(the last LIGHTNING_OUTCOME line's payload or None, the log without marker lines)."""
    marked, kept = None, []
    for line in log.split("\n"):
        if line == MARKER or line.startswith(MARKER + " "):
            marked = line[len(MARKER) + 1:]
        else:
            kept.append(line)
    text = "\n".join(kept)
    if marked is not None:  # drop the line break the wrapper put before the marker
        text = text.rstrip("\n") + "\n" if text.strip("\n") else ""
    return marked, text


def describe(exc: BaseException) -> str:
    """An API failure as one line: the status and the server's own message where it sent one."""
    if isinstance(exc, ApiException):
        message = ""
        try:
            message = json.loads(exc.body or "{}").get("message") or ""
        except (ValueError, AttributeError):
            message = (exc.body or "")[:200] if isinstance(exc.body, str) else ""
        return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
    if isinstance(exc, urllib3.exceptions.ReadTimeoutError):
        return f"no answer within {API_TIMEOUT_S:g} s"
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        return f"cannot reach the API server: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
