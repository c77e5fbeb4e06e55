"""One val task's trajectories at two evaluations side by side (/runs/<run>/val/<task>/?a=&b=&attempt=)."""
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from catalog.models import Task
from runs import rollout_services
from tests.dashboard.test_rollout_page import XSS, agent_calls

pytestmark = pytest.mark.django_db


def val_attempt(run, task, step, attempt, calls, reward, greedy=False, argument="ls"):
    """An evaluation attempt as runs.evaluation makes it: split 'val', step, group = the task's index."""
    rollout, _ = rollout_services.create_rollout(run, task=task, split="val", step=step, group=0, attempt=attempt,
                                                 greedy=greedy)
    rollout_services.record_calls(agent_calls(rollout.pk, calls, argument))
    rollout_services.start_rollout(rollout.pk)
    return rollout_services.finish_rollout(rollout.pk, status="succeeded", reward=reward, reward_detail={},
                                           exit_code=0)


@pytest.fixture
def evaluated(alice, make_run):
    """Val task t0 evaluated at steps 0, 5 and 10: two sampled attempts and a greedy one each; it flips to pass."""
    run = make_run(alice)
    task = Task.objects.get(dataset=run.dataset, external_id="t0")
    rollouts = {}
    for step, calls, reward in ((0, 1, 0.0), (5, 2, 0.0), (10, 3, 1.0)):
        for attempt in range(2):
            rollouts[step, attempt] = val_attempt(run, task, step, attempt, calls + attempt, reward,
                                                  argument=f"s{step}a{attempt}")
        rollouts[step, "greedy"] = val_attempt(run, task, step, 2, 1, 1.0, greedy=True, argument=f"g{step}")
    return run, task, rollouts


def url(run, task, query=""):
    return f"/runs/{run.pk}/val/{task.pk}/{query}"


def header(html, side):
    return re.search(rf'<th class="side-{side}"(.*?)</th>', html, re.S).group(1)


def test_it_shows_the_first_and_last_evaluations_side_by_side_turn_by_turn(client, alice, evaluated):
    run, task, rollouts = evaluated
    client.force_login(alice)
    response = client.get(url(run, task))
    html = response.content.decode()

    assert response.status_code == 200
    a, b = header(html, "a"), header(html, "b")
    assert 'data-step="0"' in a and f'data-rollout="{rollouts[0, 0].pk}"' in a
    assert 'data-step="10"' in b and f'data-rollout="{rollouts[10, 0].pk}"' in b
    assert '<span class="side-reward">0.0</span>' in a and '<span class="side-pass fail">✗ fail</span>' in a
    assert '<span class="side-reward">1.0</span>' in b and '<span class="side-pass pass">✓ pass</span>' in b
    for select in ("compare-a", "compare-b"):
        options = re.search(rf'<select id="{select}" name="\w">(.*?)</select>', html, re.S).group(1)
        assert re.findall(r'<option value="(\d+)"', options) == ["0", "5", "10"]
    assert '<option value="0" selected>0</option>' in html and '<option value="10" selected>10</option>' in html
    # A made 1 call (3 turns), B made 3 (3 + 2 + 2 new turns): 7 rows, A's side empty after its third
    rows = re.findall(r'<tr class="turn-row" data-turn="(\d+)">(.*?)</tr>', html, re.S)
    assert [int(i) for i, _ in rows] == list(range(7))
    cells = [re.search(r'<td class="turn-a">(.*?)</td>\s*<td class="turn-b">(.*?)</td>', row, re.S).groups()
             for _, row in rows]
    assert "You are an agent." in cells[0][0] and "You are an agent." in cells[0][1]
    assert "s0a0 0" in cells[2][0] and "s10a0 0" in cells[2][1]
    assert 'turn-tool' in cells[3][1] and "output 0" in cells[3][1] and "turn" not in cells[3][0]
    assert "s10a0 2" in cells[6][1]


def test_it_picks_the_steps_and_the_attempt_asked_for(client, alice, evaluated):
    run, task, rollouts = evaluated
    client.force_login(alice)

    html = client.get(url(run, task, "?a=5&b=10&attempt=1")).content.decode()
    assert f'data-rollout="{rollouts[5, 1].pk}"' in header(html, "a")
    assert f'data-rollout="{rollouts[10, 1].pk}"' in header(html, "b")
    assert '<option value="1" selected>1</option>' in html

    html = client.get(url(run, task, "?a=0&b=5&attempt=greedy")).content.decode()
    assert f'data-rollout="{rollouts[0, "greedy"].pk}"' in header(html, "a")
    assert "(greedy)" in header(html, "b") and '<span class="side-pass pass">' in header(html, "a")


def test_the_greedy_attempt_is_shown_when_it_is_all_there_is(client, alice, make_run):
    run = make_run(alice)
    task = Task.objects.get(dataset=run.dataset, external_id="t0")
    greedy = [val_attempt(run, task, step, 0, 1, 1.0, greedy=True) for step in (0, 2)]
    client.force_login(alice)
    html = client.get(url(run, task)).content.decode()

    assert f'data-rollout="{greedy[0].pk}"' in header(html, "a") and "(greedy)" in header(html, "a")
    assert f'data-rollout="{greedy[1].pk}"' in header(html, "b")


def test_a_step_without_an_evaluation_shows_an_empty_side(client, alice, evaluated):
    run, task, _ = evaluated
    client.force_login(alice)
    html = client.get(url(run, task, "?a=3&b=10")).content.decode()

    assert 'class="muted side-missing"' in header(html, "a") and "s10a0 0" in html


def test_a_bad_query_is_refused_naming_the_parameter(client, alice, evaluated):
    run, task, _ = evaluated
    client.force_login(alice)
    response = client.get(url(run, task, "?a=first"))
    assert response.status_code == 400 and "a must be an evaluation step" in response.content.decode()
    response = client.get(url(run, task, "?attempt=best"))
    assert response.status_code == 400 and "attempt must be a whole number or" in response.content.decode()


def test_tool_arguments_are_escaped(client, alice, make_run):
    run = make_run(alice)
    task = Task.objects.get(dataset=run.dataset, external_id="t0")
    val_attempt(run, task, 0, 0, 1, 0.0, argument=XSS)
    client.force_login(alice)
    html = client.get(url(run, task)).content.decode()

    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_it_costs_a_fixed_number_of_queries(client, alice, evaluated, django_assert_max_num_queries):
    run, task, _ = evaluated
    client.force_login(alice)
    with CaptureQueriesContext(connection) as few:
        client.get(url(run, task))
    for step in (20, 30, 40):
        val_attempt(run, task, step, 0, 30, 1.0)
    with django_assert_max_num_queries(len(few)):
        html = client.get(url(run, task, "?a=20&b=40")).content.decode()
    assert len(re.findall(r'<tr class="turn-row"', html)) == 3 + 29 * 2  # 3 turns, then 2 new a call


def test_it_is_owner_only_and_the_task_must_be_the_runs(client, alice, bob, evaluated, make_run):
    run, task, _ = evaluated
    other = make_run(alice, name="other")
    client.force_login(bob)
    assert client.get(url(run, task)).status_code == 404
    client.force_login(alice)
    assert client.get(url(other, task)).status_code == 404
    client.logout()
    assert client.get(url(run, task)).status_code == 302
