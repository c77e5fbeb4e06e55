"""The API of run health: a run's alarms (list, acknowledge) and its re-scorings (start, list, one with its
per-rollout results). Routes under /api/v1/runs/<run>/ (api/urls.py); the run must be the caller's (404 else)."""
from __future__ import annotations

from django.http import Http404
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from api.errors import ErrorSerializer
from catalog import selectors as catalog_selectors
from catalog.models import RewardScript
from health import rescoring
from health import services as health_services
from health.models import AlarmKind, Rescore, RescoredRollout, RescoreScope, RunAlarm
from runs.models import Run


class AlarmSerializer(serializers.ModelSerializer):
    label = serializers.CharField(source="get_kind_display", read_only=True)
    acknowledged_by = serializers.CharField(source="acknowledged_by.username", default=None, read_only=True,
                                            allow_null=True)

    class Meta:
        model = RunAlarm
        fields = ["id", "run", "step", "kind", "label", "severity", "message", "evidence", "rollout_ids", "created_at",
                  "acknowledged_at", "acknowledged_by"]
        read_only_fields = fields


class RescoreSerializer(serializers.ModelSerializer):
    reward_script_name = serializers.CharField(source="reward_snapshot.name", default=None, read_only=True,
                                               allow_null=True)
    reward_script_version = serializers.IntegerField(source="reward_snapshot.version", default=None, read_only=True,
                                                     allow_null=True)

    class Meta:
        model = Rescore
        fields = ["id", "run", "reward_script", "reward_script_name", "reward_script_version", "scope", "step",
                  "status", "total", "done", "summary", "error", "created_at", "finished_at"]
        read_only_fields = fields


class RescoreCreateSerializer(serializers.Serializer):
    reward_script = serializers.PrimaryKeyRelatedField(queryset=RewardScript.objects.all(),
                                                       help_text="The script (at its current version) to score with")
    scope = serializers.ChoiceField(choices=RescoreScope.choices, default=RescoreScope.ALL)
    step = serializers.IntegerField(min_value=0, max_value=rescoring.MAX_STEP, required=False, allow_null=True,
                                    help_text="With scope=step: the step whose train batch and evaluation to score")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        request = self.context.get("request")
        if request is not None:  # another user's script is not found, as everywhere in the API
            self.fields["reward_script"].queryset = catalog_selectors.owned(RewardScript.objects.all(), request.user)


class RescoredRolloutSerializer(serializers.ModelSerializer):
    split = serializers.CharField(source="rollout.split", read_only=True)
    step = serializers.IntegerField(source="rollout.step", read_only=True)
    task = serializers.CharField(source="rollout.task.external_id", default=None, read_only=True, allow_null=True)
    changed = serializers.BooleanField(read_only=True, help_text="Scored, and the reward differs from the run's")

    class Meta:
        model = RescoredRollout
        fields = ["rollout", "split", "step", "task", "old_reward", "new_reward", "changed", "detail", "error"]
        read_only_fields = fields


ERRORS = {code: ErrorSerializer for code in (400, 401, 403, 404, 405, 409)}
"""The error shape (api.errors) of every refusal these views can answer with."""
BIGGEST_ID = 2**63 - 1  # a larger id in the path is no row (and no database error)


def _run(request, run_id) -> Run:
    run_id = int(run_id)  # any integer in the path: one no row has is a JSON 404
    if not 0 < run_id <= BIGGEST_ID:
        raise Http404
    return get_object_or_404(catalog_selectors.owned(Run.objects.all(), request.user), pk=run_id)


def _child(model, run: Run, pk):
    pk = int(pk)
    if not 0 < pk <= BIGGEST_ID:
        raise Http404
    return get_object_or_404(model, run=run, pk=pk)


class RunAlarmsView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(parameters=[OpenApiParameter("open", bool, description="Only alarms not acknowledged"),
                               OpenApiParameter("kind", str, enum=AlarmKind.values)],
                   responses={200: AlarmSerializer(many=True), **ERRORS})
    def get(self, request, run_id: int):
        """The run's alarms, step by step (health.rules says what each kind means)."""
        alarms = _run(request, run_id).alarms.select_related("acknowledged_by").order_by("step", "kind")
        if request.query_params.get("open") in ("1", "true"):
            alarms = alarms.filter(acknowledged_at__isnull=True)
        if request.query_params.get("kind"):
            alarms = alarms.filter(kind=request.query_params["kind"])
        return Response(AlarmSerializer(alarms, many=True).data)


class AlarmAcknowledgeView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(request=None, responses={200: AlarmSerializer, **ERRORS})
    def post(self, request, run_id: int, alarm_id: int):
        """Mark the alarm seen: it stays listed; the runs list no longer counts it. A second time is a 409."""
        alarm = _child(RunAlarm, _run(request, run_id), alarm_id)
        return Response(AlarmSerializer(health_services.acknowledge(alarm, request.user)).data)


class RunRescoresView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(responses={200: RescoreSerializer(many=True), **ERRORS})
    def get(self, request, run_id: int):
        return Response(RescoreSerializer(_run(request, run_id).rescores.all(), many=True).data)

    @extend_schema(request=RescoreCreateSerializer, responses={201: RescoreSerializer, **ERRORS})
    def post(self, request, run_id: int):
        """Re-score the run's stored rollouts (all, one step's, or the flagged ones) with a reward script, as a
        background job; the run's own rewards are never changed."""
        run = _run(request, run_id)
        body = RescoreCreateSerializer(data=request.data, context={"request": request})
        body.is_valid(raise_exception=True)
        data = body.validated_data
        rescore = rescoring.start_rescore(request.user, run, data["reward_script"], data["scope"], data.get("step"))
        return Response(RescoreSerializer(rescore).data, status=status.HTTP_201_CREATED)


class RescoreDetailView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(parameters=[OpenApiParameter("changed", bool, description="Only rollouts whose reward changed")],
                   responses={200: RescoreSerializer, **ERRORS})
    def get(self, request, run_id: int, rescore_id: int):
        """The re-scoring with its summary, and a page of its per-rollout results (`results`, limit/offset)."""
        rescore = _child(Rescore, _run(request, run_id), rescore_id)
        rows = rescore.results.select_related("rollout", "rollout__task").order_by("rollout_id")
        if request.query_params.get("changed") in ("1", "true"):
            rows = rows.changed()
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(rows, request, view=self)
        return Response({**RescoreSerializer(rescore).data, "results_count": paginator.count,
                         "results": RescoredRolloutSerializer(page, many=True).data})
