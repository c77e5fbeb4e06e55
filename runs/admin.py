"""Admin registrations of the runs app's tables."""
from django.contrib import admin

from runs.models import HarnessCheck, Metric, ModelCall, Rollout, Run, RunEvent, Sample


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "status", "step", "created_at")
    list_filter = ("status",)
    raw_id_fields = ("harness", "dataset", "reward_script", "cloned_from")


@admin.register(Rollout)
class RolloutAdmin(admin.ModelAdmin):
    list_display = ("id", "run", "split", "step", "group", "attempt", "status", "failure_kind", "reward")
    list_filter = ("status", "failure_kind", "split")
    raw_id_fields = ("run", "task")
    exclude = ("secret_hash",)


@admin.register(ModelCall)
class ModelCallAdmin(admin.ModelAdmin):
    list_display = ("id", "rollout", "seq", "api", "status_code", "finish_reason", "drift", "latency_ms")
    list_filter = ("api", "drift")
    raw_id_fields = ("rollout",)


@admin.register(Sample)
class SampleAdmin(admin.ModelAdmin):
    list_display = ("id", "rollout", "index", "build", "advantage")
    raw_id_fields = ("rollout",)


@admin.register(Metric)
class MetricAdmin(admin.ModelAdmin):
    list_display = ("run", "step", "name", "value")
    raw_id_fields = ("run",)


@admin.register(RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ("run", "seq", "kind", "created_at")
    raw_id_fields = ("run",)


@admin.register(HarnessCheck)
class HarnessCheckAdmin(admin.ModelAdmin):
    list_display = ("harness", "harness_version", "engine", "model", "status", "owner", "created_at")
    list_filter = ("status", "engine")
    raw_id_fields = ("harness", "reward_script", "owner")
