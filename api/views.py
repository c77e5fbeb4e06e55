"""REST API viewsets: everything the dashboard does. Reads filter by owner; writes call services."""
from __future__ import annotations

import django_filters
from django.db.models import Count, Prefetch, Q
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, mixins, serializers, status, viewsets
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from api import catalog_serializers as cs
from api import run_serializers as s  # runs, rollouts, workers; cs: the catalog's
from api.errors import ErrorSerializer
from api.permissions import IsOwnerOrStaff
from api.renderers import JSONLinesRenderer
from catalog import registry, reward_tests
from catalog import selectors as catalog_selectors
from catalog import services as catalog_services
from catalog.models import Dataset, Harness, RewardScript, Split, Task
from dashboard.export import export_response
from dashboard.rollout_queries import QueryError, RolloutQuery
from lightning_web import login_limits
from runs import check_services, selectors, services, signal, worker_status
from runs.models import HarnessCheck, ModelCall, Rollout, RolloutStatus, Run, Sample


class OwnedViewSet(viewsets.GenericViewSet):
    permission_classes = [IsAuthenticated, IsOwnerOrStaff]

    def get_queryset(self):
        return catalog_selectors.owned(self.queryset.all(), self.request.user)


class ServiceWrites:
    """create/update through the services named on the viewset (names are checked in the serializers)."""

    create_service = update_service = None

    def perform_create(self, serializer):
        serializer.instance = type(self).create_service(self.request.user, **serializer.validated_data)

    def perform_update(self, serializer):
        serializer.instance = type(self).update_service(serializer.instance, **serializer.validated_data)


class HarnessViewSet(ServiceWrites, OwnedViewSet, viewsets.ModelViewSet):
    queryset = Harness.objects.all()
    serializer_class = cs.HarnessSerializer
    filterset_fields = ["executor"]
    create_service, update_service = catalog_services.create_harness, catalog_services.update_harness

    def perform_destroy(self, instance):
        catalog_services.delete_harness(instance, self.request.user)  # refused (409) while a run uses it

    @extend_schema(methods=["GET"], request=None, responses=s.HarnessCheckSerializer(many=True))
    @extend_schema(methods=["POST"], request=s.HarnessCheckCreateSerializer, responses={202: s.HarnessCheckSerializer})
    @action(detail=True, methods=["get", "post"])
    def checks(self, request, pk=None):
        """POST: queue a check (the harness run once on one task through the proxy); GET: its checks, newest first."""
        harness = self.get_object()
        if request.method == "GET":
            rows = catalog_selectors.owned(harness.checks.all(), request.user)
            return self.get_paginated_response(s.HarnessCheckSerializer(self.paginate_queryset(rows), many=True).data)
        body = s.HarnessCheckCreateSerializer(data=request.data, context={"request": request})
        body.is_valid(raise_exception=True)
        check = check_services.start_harness_check(request.user, harness, **body.validated_data)
        return Response(s.HarnessCheckSerializer(check).data, status=status.HTTP_202_ACCEPTED)


class HarnessCheckViewSet(OwnedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Harness checks: queued through POST /harnesses/<id>/checks/; their status and report here."""

    queryset = HarnessCheck.objects.all()
    serializer_class = s.HarnessCheckSerializer
    filterset_fields = ["harness", "status"]


class RewardScriptViewSet(ServiceWrites, OwnedViewSet, viewsets.ModelViewSet):
    queryset = RewardScript.objects.all()
    serializer_class = cs.RewardScriptSerializer
    create_service, update_service = catalog_services.create_reward_script, catalog_services.update_reward_script

    def perform_destroy(self, instance):
        catalog_services.delete_reward_script(instance, self.request.user)  # refused (409) while a run uses it

    @extend_schema(request=cs.RewardTestSerializer, responses={200: cs.RewardTestResultSerializer, 503: ErrorSerializer})
    @action(detail=True, methods=["post"])
    def test(self, request, pk=None):
        """Score a task and an outcome in the reward sandbox, on the control worker (the API server runs no user
        code), and answer once scored; a failing script answers ok=false with the error; 503 when no worker scored
        it within the script's timeout plus 30 s."""
        script = self.get_object()
        catalog_services.check_owner(request.user, script)
        body = cs.RewardTestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            result = reward_tests.score_on_worker(request.user, {
                "source": script.source, "timeout_s": script.timeout_s, "task": body.validated_data["task"],
                "task_label": "the API's", "outcome": body.validated_data["outcome"]})
        except reward_tests.NoWorker as exc:
            return Response({"error": {"status": 503, "code": "no_worker", "message": str(exc)}},
                            status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response(result)


class DatasetViewSet(OwnedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.UpdateModelMixin,
                     mixins.DestroyModelMixin):
    queryset = Dataset.objects.all()
    serializer_class = cs.DatasetSerializer
    parser_classes = [MultiPartParser, FormParser, JSONParser]

    def perform_destroy(self, instance):
        catalog_services.delete_dataset(instance, self.request.user)  # refused (409) while a run uses it

    @extend_schema(request={"multipart/form-data": cs.DatasetUploadSerializer}, responses={201: cs.DatasetSerializer})
    def create(self, request):
        """Upload tasks as JSONL or a JSON array; every bad line is reported and nothing is saved."""
        upload = cs.DatasetUploadSerializer(data=request.data, context={"request": request})
        upload.is_valid(raise_exception=True)
        data = upload.validated_data
        file = data["file"]
        dataset = catalog_services.create_dataset(
            request.user, name=data["name"], description=data["description"], content=file.read(),
            filename=file.name or "", split_field=data["split_field"], val_ratio=data["val_ratio"],
            seed=data["seed"], required_fields=data["required_fields"], hidden_fields=data["hidden_fields"])
        return Response(cs.DatasetSerializer(dataset).data, status=status.HTTP_201_CREATED)


class TaskFilter(django_filters.FilterSet):
    class Meta:
        model = Task
        fields = ["dataset", "split"]


class TaskViewSet(OwnedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    queryset = Task.objects.all()
    serializer_class = cs.TaskSerializer
    filterset_class = TaskFilter

    def get_queryset(self):
        return super().get_queryset().order_by("dataset_id", "index")


class RunViewSet(OwnedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin):
    queryset = Run.objects.all()
    serializer_class = s.RunSerializer
    filterset_fields = ["status", "harness", "dataset"]

    def get_queryset(self):
        return super().get_queryset().annotate(  # an aggregate drops Meta.ordering: say it again
            open_alarms_n=Count("alarms", filter=Q(alarms__acknowledged_at__isnull=True))).order_by(*Run._meta.ordering)

    @extend_schema(request=s.RunCreateSerializer, responses={201: s.RunSerializer})
    def create(self, request):
        """Validate the config against TrainerConfig, snapshot harness, dataset and reward script, enqueue."""
        body = s.RunCreateSerializer(data=request.data, context={"request": request})
        body.is_valid(raise_exception=True)
        run = services.create_run(request.user, **body.validated_data)
        return Response(s.RunSerializer(run).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.delete_run(instance, self.request.user)

    @extend_schema(request=None, responses=s.RunSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        run = services.cancel_run(self.get_object(), request.user)
        return Response(s.RunSerializer(run).data)

    @extend_schema(request=None, responses=s.RunSerializer)
    @action(detail=True, methods=["post"])
    def finish(self, request, pk=None):
        """End a starting or running run after the step it trains now: it then evaluates, saves a checkpoint and
        succeeds, its config's `steps` lowered to that step (continue adds more later)."""
        run = services.finish_run(self.get_object(), request.user)
        return Response(s.RunSerializer(run).data)

    @extend_schema(request=None, responses=s.RunSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        """Put a failed or cancelled run back in the queue; it goes on from its last checkpoint."""
        run = services.resume_run(self.get_object(), request.user)
        return Response(s.RunSerializer(run).data)

    @extend_schema(request=s.RunContinueSerializer, responses=s.RunSerializer)
    @action(detail=True, methods=["post"], url_path="continue", url_name="continue")
    def continue_run(self, request, pk=None):
        """Train a succeeded run `steps` more steps from its final checkpoint (its config's steps grow by that)."""
        body = s.RunContinueSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        run = services.continue_run(self.get_object(), request.user, body.validated_data["steps"])
        return Response(s.RunSerializer(run).data)

    @extend_schema(request=s.RunCloneSerializer, responses={201: s.RunSerializer})
    @action(detail=True, methods=["post"])
    def clone(self, request, pk=None):
        body = s.RunCloneSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        run = services.clone_run(self.get_object(), request.user, body.validated_data.get("name"),
                                 pool=body.validated_data.get("pool"))
        return Response(s.RunSerializer(run).data, status=status.HTTP_201_CREATED)

    @extend_schema(parameters=[
        OpenApiParameter("name", OpenApiTypes.STR, many=True, description="Metric name(s); repeat or comma-separate"),
        OpenApiParameter("step_min", OpenApiTypes.INT), OpenApiParameter("step_max", OpenApiTypes.INT)],
        responses=s.MetricSerializer(many=True))
    @action(detail=True, methods=["get"])
    def metrics(self, request, pk=None):
        run = self.get_object()
        names = [n for item in request.query_params.getlist("name") for n in item.split(",") if n]
        rows = selectors.run_metrics(run, names, _int_param(request, "step_min"), _int_param(request, "step_max"))
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(s.MetricSerializer(page, many=True).data)

    @extend_schema(parameters=[OpenApiParameter("after", OpenApiTypes.INT, description="Last seq seen")],
                   responses=s.RunEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        run = self.get_object()
        rows = run.events.filter(seq__gt=_int_param(request, "after") or 0).order_by("seq")
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(s.RunEventSerializer(page, many=True).data)

    @extend_schema(responses=s.SignalSerializer)
    @action(detail=True, methods=["get"])
    def signal(self, request, pk=None):
        """Learning signal step by step: groups sampled, with signal, trained, dropped by dynamic sampling, extra
        rollouts, the two signal shares, and the run page's notice when the sampled share is low (else null)."""
        return Response(signal.summary(self.get_object()))

    @extend_schema(responses=s.ValidationGridSerializer)
    @action(detail=True, methods=["get"])
    def validation(self, request, pk=None):
        """The validation grid: per val task and evaluated step, the sampled attempts' pass fraction and the greedy
        attempt's pass."""
        return Response(selectors.validation_grid(self.get_object()))

    @extend_schema(
        parameters=[OpenApiParameter("step", OpenApiTypes.INT),
                    OpenApiParameter("split", OpenApiTypes.STR, enum=Split.values),
                    OpenApiParameter("status", OpenApiTypes.STR, enum=RolloutStatus.values),
                    OpenApiParameter("reward_min", OpenApiTypes.NUMBER),
                    OpenApiParameter("reward_max", OpenApiTypes.NUMBER),
                    OpenApiParameter("q", OpenApiTypes.STR, description="Text in the task id or the error")],
        responses={(200, "application/jsonl"): OpenApiResponse(
            OpenApiTypes.STR, description="One JSON object per rollout, in id order: docs/export-schema.md")})
    @action(detail=True, methods=["get"], url_name="export-api",  # the page's URL is `run-export`
            filter_backends=[], pagination_class=None, renderer_classes=[JSONRenderer, JSONLinesRenderer])
    def export(self, request, pk=None):
        """The run's rollouts with their calls and samples as streamed JSONL, filtered as the run page's rollouts
        table filters them (its sort and page do not apply)."""
        run = self.get_object()
        try:
            query = RolloutQuery.from_params(request.query_params)
        except QueryError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return export_response(request, run, query)

    @extend_schema(responses=s.RolloutSerializer(many=True))
    @action(detail=True, methods=["get"])
    def rollouts(self, request, pk=None):
        run = self.get_object()
        rows = RolloutFilter(request.query_params, queryset=run.rollouts.select_related("task").order_by(*RUN_ORDER)).qs
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(s.RolloutSerializer(page, many=True).data)


def _int_param(request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise serializers.ValidationError({name: [f"must be an integer, got {value!r}"]}) from None


class ModelRegistryViewSet(viewsets.ViewSet):
    """The models registry: model folders under the models dir (imported, built or checkpointed)."""

    @extend_schema(responses=cs.ModelInfoSerializer(many=True))
    def list(self, request):
        return Response(cs.ModelInfoSerializer([m.to_dict() for m in registry.registered_models()], many=True).data)


class WorkersView(APIView):
    """The live Celery workers: their pools (queues), heartbeat, and the runs they hold on which device sets.

    One object, not a list (a ViewSet's `list` would be documented as an array): when it was asked, for how long,
    whether any worker answered, and the workers."""

    @extend_schema(responses=s.WorkersSerializer, operation_id="workers_list")
    def get(self, request):
        """Ask every worker (ping, stats, active, active_queues, a heartbeat) for up to a second; answered=false
        when none did."""
        return Response(s.WorkersSerializer(worker_status.inspect_workers(request.user)).data)


RUN_ORDER = ("step", "group", "attempt", "id")
"""Rollouts of one run in Rollout.Meta.ordering's order, spelt out: the Meta's leading "run" sorts by the run's
created_at, which joins runs_run and sorts all the run's rollouts before a page is cut (rollout_run_step serves
this order instead)."""


class RolloutFilter(django_filters.FilterSet):
    class Meta:
        model = Rollout
        fields = ["run", "status", "split", "step", "greedy"]


class RolloutViewSet(OwnedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Rollouts of the user's runs; the detail holds every recorded call and training sample."""

    queryset = Rollout.objects.select_related("task").order_by("-run_id", *RUN_ORDER)  # newest run first, no join
    filterset_class = RolloutFilter
    permission_classes = [IsAuthenticated]  # the queryset already holds only the user's rollouts

    def get_queryset(self):
        rows = super().get_queryset()
        if self.action == "retrieve":  # in their own order (the Meta orderings sort by the rollout's run first)
            rows = rows.prefetch_related(Prefetch("calls", ModelCall.objects.order_by("seq")),
                                         Prefetch("samples", Sample.objects.order_by("index")))
        return rows

    def get_serializer_class(self):
        return s.RolloutDetailSerializer if self.action == "retrieve" else s.RolloutSerializer


class TokenLoginView(ObtainAuthToken):
    """POST a username and password for that user's API token. Failed attempts count like the login page's
    (django-axes): past the limit the answer is 429 until the cool-off ends, even for the right password."""

    def post(self, request, *args, **kwargs):
        try:
            return super().post(request, *args, **kwargs)
        except exceptions.ValidationError:
            if getattr(request, "axes_locked_out", False):  # set by axes on this request when it refused the login
                raise exceptions.Throttled(wait=login_limits.retry_after_s(),
                                           detail=login_limits.lockout_message()) from None
            raise
