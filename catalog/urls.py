"""Catalog pages: harnesses (with their templates and checks), reward scripts, datasets, the models registry."""
from catalog.pages import datasets, harnesses, models, rewards

urlpatterns = [
    *harnesses.urlpatterns,
    *rewards.urlpatterns,
    *datasets.urlpatterns,
    *models.urlpatterns,
]
