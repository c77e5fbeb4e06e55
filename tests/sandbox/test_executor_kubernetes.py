"""The Kubernetes Job executor against kmock's emulated API server (the official client talks HTTP to it through
a kubeconfig). The tests play the Job controller and kubelet: they run the pod's own command (the wrapper and the
harness argv, from the Job body the API received) as a local process, then post the pod and the Job's status."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import kmock
import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import Client
from django.utils.html import escape

from catalog import services as catalog_services
from catalog.models import Harness, Task
from runs import services
from runs.harness_source import HarnessSource
from runs.models import Rollout
from sandbox.executors import for_harness
from sandbox.executors import kubernetes as k8s
from sandbox.executors.base import Attempt, ExecutorSetupError
from sandbox.executors.local import LocalExecutor
from tests.conformance.conftest import tiny_tokenizer_dir  # noqa: F401 (fixture)

JOBS = kmock.resource("batch/v1/jobs")
PODS = kmock.resource("v1/pods")
ADVERTISE = "http://lightning-proxy.lw.svc:8100"
TASK = {"id": "t1", "question": "2+2"}
HARNESS = r'''
import json, sys
task = json.load(open(sys.argv[1]))
print("working on", task["question"], flush=True)
print("to stderr", file=sys.stderr)
size = int(sys.argv[3])
open(sys.argv[2], "w").write(json.dumps({"answer": "4", "pad": "x" * size, "echo": task["id"]}, indent=1))
sys.exit(int(sys.argv[4]))
'''


@pytest.fixture
def cluster(kmock, settings, tmp_path):
    """Settings that point the executor at kmock through a kubeconfig; the pods reach the proxy at ADVERTISE."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "tester", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}]}))
    settings.LIGHTNING_K8S_KUBECONFIG = str(kubeconfig)
    settings.LIGHTNING_K8S_NAMESPACE = "lw"
    settings.LIGHTNING_K8S_JOB_TTL_S = 600
    settings.LIGHTNING_PROXY_HOST = "0.0.0.0"
    settings.LIGHTNING_PROXY_ADVERTISE_URL = ADVERTISE
    return kmock


def attempt(tmp_path, size=0, code=0, timeout_s=300.0, **changes) -> Attempt:
    fields = dict(command=[sys.executable, "-c", braces(HARNESS), "{task_file}", "{output_file}", str(size), str(code)],
                  env={"MODE": "fast", "WHERE": "{workdir}"}, timeout_s=timeout_s, workdir=tmp_path / "unused",
                  task_id="t1", task=TASK, rollout_id="7", base_url="http://127.0.0.1:41234/rollouts/7/v1",
                  api_key="secret-key", model="policy", run_id="3", step=2)
    return Attempt(**{**fields, **changes})


def braces(text: str) -> str:
    """`text` as an argv template writes it: literal braces doubled."""
    return text.replace("{", "{{").replace("}", "}}")


async def created_job(api) -> dict:
    """The Job body the API server received (waits for the executor to post it)."""
    for _ in range(1000):
        posts = [request for request in list(api) if request.method == "POST" and is_jobs(request)]
        if posts:
            return posts[0].data
        await asyncio.sleep(0.01)
    raise AssertionError("no Job was created")


async def watching(api) -> None:
    """Returns once the executor watches its Job."""
    for _ in range(1000):
        if any(request.params.get("watch") == "true" for request in list(api) if is_jobs(request)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the executor never watched its Job")


def run_pod(job: dict, root: Path, sigterm_after: float | None = None) -> dict:
    """Run the Job's container as the kubelet would (the emptyDir at `root`): its log and termination message."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item["value"].replace(k8s.ROOT, str(root)) for item in container["env"]}
    env.update(PATH=os.environ["PATH"], LIGHTNING_TERMINATION_LOG=str(root / "termination-log"))
    root.mkdir(parents=True, exist_ok=True)
    argv = [arg.replace(k8s.ROOT, str(root)) for arg in container["command"]]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if sigterm_after is not None:
        try:
            proc.wait(sigterm_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=30)[0].decode()
    message = (root / "termination-log").read_text() if (root / "termination-log").exists() else ""
    return {"log": log, "exit_code": proc.returncode, "message": message}


async def finish(api, job: dict, *, pod_status: dict | None, log: str = "", condition=("Complete", "")):
    """Post the Job's pod (with `pod_status`) and its log, then mark the Job ended."""
    name = job["metadata"]["name"]
    if pod_status is not None:
        api[PODS, kmock.subresource("log")] << log.encode()
        pod = {"metadata": {"name": f"{name}-abcde", "namespace": "lw", "creationTimestamp": "2026-12-03T00:00:00Z",
                            "labels": {**job["spec"]["template"]["metadata"]["labels"], "job-name": name}},
               "spec": {"containers": [{"name": "harness", "image": "x"}]}, "status": pod_status}
        assert (await api.post("/api/v1/namespaces/lw/pods", json=pod)).status == 200
    kind, reason = condition
    status = {"conditions": [{"type": kind, "status": "True", "reason": reason, "message": f"job {reason}"}]}
    assert (await api.patch(f"/apis/batch/v1/namespaces/lw/jobs/{name}", json={"status": status})).status == 200


def terminated(exit_code: int, message: str = "", reason: str = "Completed") -> dict:
    return {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [
        {"name": "harness", "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}}}]}


def deletes(api) -> list:
    return [request for request in list(api) if request.method == "DELETE" and is_jobs(request)]


def is_jobs(request) -> bool:
    return request.url.path.startswith("/apis/batch/v1/namespaces/lw/jobs")


# ---------------------------------------------------------------------- the Job and the outcomes


async def test_it_creates_one_job_with_the_rollouts_payload_and_reads_the_outcome(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1",
                            "resources": {"cpu": "500m", "memory": "1Gi", "gpu": 1}})
    running = asyncio.create_task(executor.run(attempt(tmp_path, timeout_s=90)))
    job = await created_job(cluster)

    labels = {"app.kubernetes.io/managed-by": "lightning-web", "lightning/run": "3", "lightning/rollout": "7",
              "lightning/step": "2"}
    assert job["metadata"]["namespace"] == "lw" and job["metadata"]["labels"] == labels
    assert job["metadata"]["name"].startswith("lw-3-7-")
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (0, 90, 600)
    pod = spec["template"]
    assert pod["metadata"]["labels"] == labels and pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/me/agent:1"
    assert container["command"][:2] == ["/bin/sh", "-c"] and container["command"][3] == "lightning-harness"
    assert container["command"][4:] == [sys.executable, "-c", HARNESS, "/lightning/task.json",
                                        "/lightning/output.json", "0", "0"]
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"},
                                      "limits": {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "1"}}
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["OPENAI_BASE_URL"] == f"{ADVERTISE}/rollouts/7/v1" and env["OPENAI_API_KEY"] == "secret-key"
    assert env["ANTHROPIC_BASE_URL"] == f"{ADVERTISE}/rollouts/7" and env["ANTHROPIC_API_KEY"] == "secret-key"
    assert json.loads(env["LIGHTNING_TASK_JSON"]) == TASK
    assert (env["MODE"], env["WHERE"], env["LIGHTNING_MODEL"]) == ("fast", "/lightning/work", "policy")
    assert container["terminationMessagePath"] == "/dev/termination-log"

    pod_run = run_pod(job, tmp_path / "pod")
    assert pod_run["exit_code"] == 0 and json.loads(pod_run["message"])["answer"] == "4"
    await finish(cluster, job, pod_status=terminated(0, pod_run["message"]), log=pod_run["log"])
    out = await running
    assert (out.exit_code, out.timed_out, out.error) == (0, False, "")
    assert out.outcome == {"answer": "4", "pad": "", "echo": "t1", "exit_code": 0,
                           "stdout": "working on 2+2\nto stderr\n"}
    assert out.stdout_tail == "working on 2+2\nto stderr\n" and k8s.MARKER not in out.stdout_tail
    assert deletes(cluster) == []  # the TTL removes it


def test_the_job_body_is_a_valid_batch_v1_job_by_the_kubernetes_schema(cluster, tmp_path):
    import kubernetes_validate

    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1",
                            "resources": {"cpu": "2", "memory": "512Mi", "gpu": "1"}})
    body = executor.job_body(attempt(tmp_path), "lw-3-7-abcdef")
    assert kubernetes_validate.validate(body, "1.37.0", strict=True) == "1.37"  # raises on any schema error


async def test_an_outcome_too_large_for_the_termination_message_comes_from_the_log_marker(cluster, tmp_path,
                                                                                        settings):
    settings.LIGHTNING_K8S_JOB_TTL_S = 0  # no TTL: the executor deletes the Job once it has read it
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path, size=6000)))
    job = await created_job(cluster)
    assert "ttlSecondsAfterFinished" not in job["spec"] and "resources" not in job["spec"]["template"]["spec"][
        "containers"][0]
    pod_run = run_pod(job, tmp_path / "pod")
    assert pod_run["message"] == "" and f"\n{k8s.MARKER} " in pod_run["log"]
    await finish(cluster, job, pod_status=terminated(0), log=pod_run["log"])
    out = await running
    assert out.exit_code == 0 and out.error == ""
    assert out.outcome["answer"] == "4" and out.outcome["pad"] == "x" * 6000 and out.outcome["echo"] == "t1"
    assert [request.params.get("propagationPolicy") or request.data.get("propagationPolicy")
            for request in deletes(cluster)] == ["Background"]
    assert cluster.objects[JOBS, "lw", job["metadata"]["name"]].deleted


async def test_a_harness_that_exits_non_zero_is_a_failure_with_its_code(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path, code=3)))
    job = await created_job(cluster)
    pod_run = run_pod(job, tmp_path / "pod")
    assert pod_run["exit_code"] == 3
    await finish(cluster, job, pod_status=terminated(3, pod_run["message"], "Error"), log=pod_run["log"],
                 condition=("Failed", "BackoffLimitExceeded"))
    out = await running
    assert (out.exit_code, out.timed_out, out.error) == (3, False, "harness exited with code 3")
    assert out.outcome["exit_code"] == 3 and out.outcome["answer"] == "4"


async def test_an_oom_killed_harness_says_so(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path)))
    job = await created_job(cluster)
    await finish(cluster, job, pod_status=terminated(137, "", "OOMKilled"), log="eating memory\n",
                 condition=("Failed", "BackoffLimitExceeded"))
    out = await running
    assert out.exit_code == 137 and out.error == "harness exited with code 137 (OOMKilled: it outgrew its memory limit)"
    assert out.outcome == {"exit_code": 137, "stdout": "eating memory\n"}


async def test_a_job_past_its_deadline_is_a_timeout(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path, timeout_s=5)))
    job = await created_job(cluster)
    # Kubernetes deletes the pods of a Job past its deadline: no pod is left to read.
    await finish(cluster, job, pod_status=None, condition=("Failed", "DeadlineExceeded"))
    out = await running
    assert (out.exit_code, out.timed_out, out.error) == (-9, True, "harness timed out after 5 s")
    assert out.outcome == {"exit_code": -9, "stdout": ""}


async def test_the_wrapper_hands_back_the_output_when_the_deadline_sends_sigterm(cluster, tmp_path):
    """The kubelet SIGTERMs the container at the deadline: the harness gets it, and what it wrote comes back."""
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    slow = "import sys, time; open(sys.argv[1], 'w').write('{\"partial\": true}'); print('wrote', flush=True); " \
           "time.sleep(60)"
    running = asyncio.create_task(executor.run(attempt(tmp_path, command=[sys.executable, "-c", braces(slow),
                                                                          "{output_file}"], timeout_s=1)))
    job = await created_job(cluster)
    pod_run = await asyncio.to_thread(run_pod, job, tmp_path / "pod", 1.0)
    assert pod_run["exit_code"] == 143 and pod_run["message"] == '{"partial": true}'
    await finish(cluster, job, pod_status=terminated(143, pod_run["message"], "Error"), log=pod_run["log"],
                 condition=("Failed", "DeadlineExceeded"))
    out = await running
    assert (out.exit_code, out.timed_out, out.error) == (143, True, "harness timed out after 1 s")
    assert (out.outcome["partial"], out.outcome["exit_code"]) == (True, 143)
    assert out.outcome["stdout"].startswith("wrote\n")  # then the shell's own "Terminated", as dash says it


async def test_an_evicted_pod_is_an_infrastructure_failure(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path)))
    job = await created_job(cluster)
    evicted = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory.",
               "containerStatuses": [{"name": "harness", "state": {"running": {}}}]}
    await finish(cluster, job, pod_status=evicted, log="halfway\n", condition=("Failed", "BackoffLimitExceeded"))
    out = await running
    assert out.exit_code is None and out.outcome == {}
    assert out.error == "the harness pod was evicted: The node was low on resource: memory."
    assert out.stdout_tail == "halfway\n"


async def test_a_pod_that_cannot_pull_its_image_fails_without_waiting_for_the_deadline(cluster, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setattr(k8s, "WATCH_S", 0)
    monkeypatch.setattr(k8s, "WATCH_SLACK_S", 0.3)  # kmock keeps a watch open: look again every 0.3 s
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/nope:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path, timeout_s=3600)))
    job = await created_job(cluster)
    waiting = {"phase": "Pending", "containerStatuses": [{"name": "harness", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/me/nope:1"'}}}]}
    pod = {"metadata": {"name": "p", "namespace": "lw", "labels": {"job-name": job["metadata"]["name"]}},
           "spec": {"containers": [{"name": "harness", "image": "x"}]}, "status": waiting}
    await cluster.post("/api/v1/namespaces/lw/pods", json=pod)
    out = await running
    assert out.exit_code is None and out.outcome == {}
    assert out.error == 'the harness pod could not start: ImagePullBackOff: Back-off pulling image "ghcr.io/me/nope:1"'
    assert len(deletes(cluster)) == 1 and cluster.objects[JOBS, "lw", job["metadata"]["name"]].deleted


async def test_a_job_deleted_by_someone_else_ends_the_attempt(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path)))
    job = await created_job(cluster)
    await watching(cluster)
    await cluster.delete(f"/apis/batch/v1/namespaces/lw/jobs/{job['metadata']['name']}")
    out = await running
    assert (out.exit_code, out.error) == (None, "the harness job was deleted before it finished")


async def test_cancelling_the_attempt_deletes_its_job(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path)))
    job = await created_job(cluster)
    await watching(cluster)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    (delete,) = deletes(cluster)
    assert delete.url.path == f"/apis/batch/v1/namespaces/lw/jobs/{job['metadata']['name']}"
    assert (delete.params.get("propagationPolicy") or delete.data.get("propagationPolicy")) == "Background"
    assert cluster.objects[JOBS, "lw", job["metadata"]["name"]].deleted


async def test_cancelling_while_the_job_is_being_created_still_deletes_it(cluster, tmp_path):
    cluster["post", JOBS] << (lambda: asyncio.sleep(1)) << {}  # a slow answer; the emulator has stored the Job
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.create_task(executor.run(attempt(tmp_path)))
    job = await created_job(cluster)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert len(deletes(cluster)) == 1 and cluster.objects[JOBS, "lw", job["metadata"]["name"]].deleted


# ---------------------------------------------------------------------- an API server that refuses or hangs


@pytest.mark.parametrize("status, reason, expected, cleanup", [
    (403, "Forbidden", 'kubernetes did not create the harness job: 403 Forbidden: jobs.batch is forbidden: User '
                       '"system:serviceaccount:lw:worker" cannot create resource "jobs"', 0),
    (500, "Internal Server Error", "kubernetes did not create the harness job: 500 Internal Server Error: etcd "
                                   "is down", 1),
])
async def test_an_api_server_that_refuses_gives_an_outcome_with_the_reason(cluster, tmp_path, status, reason,
                                                                           expected, cleanup):
    message = expected.split(f"{status} {reason}: ")[1]
    cluster["post", JOBS] << kmock.KubernetesError(status=status, reason=reason, message=message)
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    out = await executor.run(attempt(tmp_path))
    assert (out.exit_code, out.timed_out, out.outcome, out.error) == (None, False, {}, expected)
    assert len(deletes(cluster)) == cleanup  # after a server error the Job may exist: it is deleted


async def test_an_api_server_that_does_not_answer_times_out_with_an_outcome(cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(k8s, "API_TIMEOUT_S", 0.5)
    cluster["post", JOBS] << (lambda: asyncio.sleep(3)) << {}
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    out = await executor.run(attempt(tmp_path))
    assert (out.exit_code, out.error) == (None, "kubernetes did not create the harness job: no answer within 0.5 s")
    assert len(deletes(cluster)) == 1  # it may have been created before the answer was lost


async def test_an_api_server_lost_while_watching_fails_the_attempt_and_deletes_the_job(cluster, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setattr(k8s, "API_RETRIES", 1)
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    cluster["get", JOBS] << kmock.KubernetesError(status=503, reason="Service Unavailable", message="overloaded")
    out = await executor.run(attempt(tmp_path))
    assert out.exit_code is None
    assert out.error == "lost the kubernetes API while the harness job ran: 503 Service Unavailable: overloaded"
    assert len(deletes(cluster)) == 1


async def test_a_task_too_large_for_the_pod_env_is_refused_before_any_job(cluster, tmp_path):
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    out = await executor.run(attempt(tmp_path, task={"blob": "x" * (k8s.MAX_TASK_BYTES + 1)}))
    assert out.exit_code is None and "a kubernetes harness takes tasks up to 120 KiB" in out.error
    assert [request for request in list(cluster) if request.method == "POST"] == []


# ---------------------------------------------------------------------- the factory and the run's setup


def test_the_factory_picks_the_executor_the_harness_names(cluster):
    assert isinstance(for_harness({"executor": "local"}), LocalExecutor)
    assert isinstance(for_harness({}), LocalExecutor)
    executor = for_harness({"executor": "kubernetes", "image": "img:1", "resources": {"cpu": "1"}})
    assert isinstance(executor, k8s.KubernetesExecutor) and executor.namespace == "lw"
    with pytest.raises(ExecutorSetupError, match="harness executor 'ssh' is unknown; known: local, kubernetes"):
        for_harness({"executor": "ssh"})


def test_a_run_with_a_kubernetes_harness_gets_the_kubernetes_executor(cluster, tmp_path):
    class Run:
        pk = 3
        harness_snapshot = {"executor": "kubernetes", "image": "img:1", "command": ["agent"], "timeout_s": 60}

    source = HarnessSource(Run(), config=None, server=None, workdir=tmp_path, train_ids=[1])
    assert isinstance(source.executor, k8s.KubernetesExecutor) and source.executor.image == "img:1"


SOLVER = "import json, sys; task = json.load(open(sys.argv[1])); " \
         "json.dump({'answer': eval(task['question']), 'saw': sorted(task)}, open(sys.argv[2], 'w'))"


@pytest.mark.django_db(transaction=True)
async def test_a_rollout_of_a_kubernetes_harness_is_recorded_and_scored(cluster, alice, make_dataset, make_reward,
                                                                         tmp_path):
    """HarnessSource runs a kubernetes harness as it runs a local one: the rollout row gets the reward."""
    harness = await sync_to_async(catalog_services.create_harness)(
        alice, name="pod", command=[sys.executable, "-c", braces(SOLVER), "{task_file}", "{output_file}"],
        executor="kubernetes", image="ghcr.io/me/solver:1", timeout_s=60)
    dataset, reward = await sync_to_async(make_dataset)(alice), await sync_to_async(make_reward)(alice)
    run = await sync_to_async(services.create_run)(alice, name="k8s", model="tiny", config={}, harness=harness,
                                                   dataset=dataset, reward_script=reward)
    task = await Task.objects.aget(dataset=dataset, external_id="t1")

    class Endpoint:
        def base_url(self, rollout_id: str) -> str:
            return f"http://127.0.0.1:41234/rollouts/{rollout_id}/v1"

        def settled(self, rollout_id: str, timeout: float) -> int:
            return 0

    source = HarnessSource(run, config=None, server=Endpoint(), workdir=tmp_path / "run", train_ids=[task.pk])
    running = asyncio.create_task(source.attempt(task, "train", 0, 0, 0))
    job = await created_job(cluster)
    labels = job["metadata"]["labels"]
    assert (labels["lightning/run"], labels["lightning/step"]) == (str(run.pk), "0")
    env = {item["name"]: item["value"] for item in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "answer" not in json.loads(env["LIGHTNING_TASK_JSON"])  # the reward-only field stays out of the pod
    pod_run = run_pod(job, tmp_path / "pod")
    await finish(cluster, job, pod_status=terminated(0, pod_run["message"]), log=pod_run["log"])
    result = await running

    assert not result.failed and result.error == "" and result.reward == 1.0
    rollout = await Rollout.objects.aget(pk=int(result.rollout_id))
    assert labels["lightning/rollout"] == result.rollout_id
    assert (rollout.status, rollout.reward, rollout.exit_code) == ("succeeded", 1.0, 0)
    assert rollout.reward_detail == {"checked": True}
    await sync_to_async(connections.close_all)()  # the ORM thread's session would hold the test database open


async def test_a_harness_check_of_a_kubernetes_harness_runs_its_pod_against_the_proxy(cluster, settings, tmp_path,
                                                                                       tiny_tokenizer_dir):  # noqa: F811
    """The harness check runs a kubernetes harness as a Job too: its pod (played here by a local process) calls the
    check's proxy at the advertised address, and the verdict comes from what it recorded."""
    from runs.harness_check import OK, check_harness
    from tests.conformance.conftest import CONFORMANCE_TASK, REWARD_SOURCE
    from tests.runs.test_harness_check import AGENT

    settings.LIGHTNING_PROXY_ADVERTISE_URL = "http://127.0.0.1:{port}"  # where this machine's "pods" reach it
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    command = [sys.executable, str(agent), "good", "{task_file}", "{output_file}", "{base_url}", "{api_key}", "{model}"]
    executor = for_harness({"executor": "kubernetes", "image": "ghcr.io/me/agent:1"})
    running = asyncio.ensure_future(asyncio.to_thread(
        check_harness, command, {}, 60, CONFORMANCE_TASK, tokenizer_dir=tiny_tokenizer_dir,
        reward_source=REWARD_SOURCE, workdir=tmp_path / "work", executor=executor, proxy_host="0.0.0.0",
        check_id="12"))
    job = await created_job(cluster)
    assert job["metadata"]["labels"]["lightning/run"] == "check-12"
    env = {item["name"]: item["value"] for item in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:") and env["OPENAI_BASE_URL"].endswith(
        "/rollouts/check/v1")
    assert "expected" not in json.loads(env["LIGHTNING_TASK_JSON"])  # the reward-only field stays out of the pod
    pod_run = await asyncio.to_thread(run_pod, job, tmp_path / "pod")
    assert pod_run["exit_code"] == 0, pod_run["log"]
    await finish(cluster, job, pod_status=terminated(0, pod_run["message"]), log=pod_run["log"])
    result = await running

    assert result.verdict == OK, result.reasons
    assert len(result.calls) >= 2 and all(c.status_code == 200 for c in result.calls)
    assert result.reward["reward"] == 1.0
    assert result.outcome["files"] == {"notes.txt": "status: final\n"}


@pytest.mark.parametrize("host, advertise, message", [
    ("127.0.0.1", ADVERTISE, "cannot reach the proxy listening on 127.0.0.1: set LIGHTNING_PROXY_HOST=0.0.0.0"),
    ("0.0.0.0", "", "needs the proxy's address as pods see it: set LIGHTNING_PROXY_ADVERTISE_URL"),
])
def test_a_proxy_pods_cannot_reach_is_refused_with_the_fix(cluster, settings, host, advertise, message):
    settings.LIGHTNING_PROXY_HOST, settings.LIGHTNING_PROXY_ADVERTISE_URL = host, advertise
    with pytest.raises(ExecutorSetupError, match=message):
        for_harness({"executor": "kubernetes", "image": "img:1"})


def test_no_cluster_configuration_is_refused_with_the_fix(settings, tmp_path):
    settings.LIGHTNING_PROXY_HOST, settings.LIGHTNING_PROXY_ADVERTISE_URL = "0.0.0.0", ADVERTISE
    settings.LIGHTNING_K8S_KUBECONFIG = str(tmp_path / "missing")
    with pytest.raises(ExecutorSetupError, match="no Kubernetes cluster to run harness jobs on .* set "
                                                  "LIGHTNING_K8S_KUBECONFIG"):
        for_harness({"executor": "kubernetes", "image": "img:1"})


@pytest.mark.parametrize("advertise, expected", [
    ("http://lightning-proxy.lw.svc:8100", "http://lightning-proxy.lw.svc:8100/rollouts/7/v1"),
    ("http://10.0.0.5:{port}/", "http://10.0.0.5:41234/rollouts/7/v1"),  # the proxy's own port
    ("https://lw.example.com/proxy", "https://lw.example.com/proxy/rollouts/7/v1"),
])
def test_pods_get_the_advertised_proxy_address(settings, advertise, expected):
    settings.LIGHTNING_PROXY_ADVERTISE_URL = advertise
    assert k8s.pod_base_url("http://127.0.0.1:41234/rollouts/7/v1") == expected


# ---------------------------------------------------------------------- harness validation (API and page)

API = "/api/v1/harnesses/"
GOOD = {"name": "pod", "command": ["agent", "{task_file}"], "executor": "kubernetes", "image": "ghcr.io/me/agent:1"}


@pytest.mark.django_db
@pytest.mark.parametrize("change, field, message", [
    ({"image": "Ghcr/Me:1"}, "image", "is not a container image reference"),
    ({"image": "agent:"}, "image", "is not a container image reference"),
    ({"image": "a b"}, "image", "is not a container image reference"),
    ({"image": "me/agent@sha256:abc"}, "image", "is not a container image reference"),
    ({"resources": {"disk": "1Gi"}}, "resources", "unknown key(s) ['disk']; allowed: cpu, memory, gpu, read_only"),
    ({"resources": {"cpu": "lots"}}, "resources", "cpu must be a CPU quantity such as \"500m\" or \"2\""),
    ({"resources": {"cpu": "1Gi"}}, "resources", "cpu must be a CPU quantity"),
    ({"resources": {"cpu": "0"}}, "resources", "cpu must be a CPU quantity"),
    ({"resources": {"memory": "2GB"}}, "resources", "memory must be a memory quantity such as \"512Mi\" or \"2Gi\""),
    ({"resources": {"memory": "-1Gi"}}, "resources", "memory must be a memory quantity"),
    ({"resources": {"gpu": "one"}}, "resources", "gpu must be a whole number of GPUs"),
])
def test_the_api_rejects_a_bad_image_or_resources(alice_api, change, field, message):
    response = alice_api.post(API, {**GOOD, **change}, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert field in error["fields"] and message in error["fields"][field][0]
    assert Harness.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("image, resources", [
    ("python:3.12-slim", {"cpu": "500m", "memory": "512Mi"}),
    ("localhost:5000/team/agent@sha256:" + "a" * 64, {"cpu": 2, "memory": "2Gi", "gpu": 1}),
    ("registry.example.com:443/me/agent_x:v1.2.3", {"cpu": "0.5", "memory": "1G", "gpu": "0"}),
])
def test_the_api_accepts_good_images_and_resources(alice_api, image, resources):
    response = alice_api.post(API, {**GOOD, "image": image, "resources": resources}, format="json")
    assert response.status_code == 201, response.json()
    harness = Harness.objects.get(pk=response.json()["id"])
    assert (harness.image, harness.resources) == (image, resources)


@pytest.mark.django_db
@pytest.mark.parametrize("overrides, field, message", [
    ({"image": "Not An/Image"}, "image", "&#x27;Not An/Image&#x27; is not a container image reference"),
    ({"resources": '{"memory": "lots"}'}, "resources", "memory must be a memory quantity such as"),
])
def test_the_harness_page_shows_the_error_beside_its_field(alice, overrides, field, message):
    client = Client()
    client.force_login(alice)
    data = {"name": "pod", "description": "", "argv": ["agent", "{task_file}", ""], "env_key": [""],
            "env_value": [""], "executor": "kubernetes", "image": "ghcr.io/me/agent:1", "resources": "{}",
            "timeout_s": "120", **overrides}
    response = client.post("/harnesses/new/", data)
    page = response.content.decode()
    assert response.status_code == 200 and Harness.objects.count() == 0
    error = page.split(f'id="field-{field}"')[1].split('id="field-')[0]
    assert f'id="id_{field}_error"' in error and (message in error or escape(message) in error)


@pytest.mark.django_db
def test_a_run_of_a_kubernetes_harness_snapshots_image_and_resources(alice, make_dataset, make_reward):
    harness = catalog_services.create_harness(alice, name="pod", command=["agent"], executor="kubernetes", image="img:1",
                                      resources={"cpu": "1", "memory": "1Gi"})
    run = services.create_run(alice, name="k8s", model="tiny", config={}, harness=harness,
                              dataset=make_dataset(alice), reward_script=make_reward(alice))
    assert {key: run.harness_snapshot[key] for key in ("executor", "image", "resources")} == {
        "executor": "kubernetes", "image": "img:1", "resources": {"cpu": "1", "memory": "1Gi"}}
