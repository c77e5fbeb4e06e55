"""Admin registrations of the catalog's tables."""
from django.contrib import admin

from catalog.models import Dataset, Harness, RewardScript, Task


@admin.register(Harness)
class HarnessAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "executor", "version", "updated_at")
    list_filter = ("executor",)
    search_fields = ("name",)


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "train_count", "val_count", "hidden_fields", "created_at")
    search_fields = ("name",)


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ("external_id", "dataset", "split", "index")
    list_filter = ("split",)
    raw_id_fields = ("dataset",)


@admin.register(RewardScript)
class RewardScriptAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "version", "updated_at")
