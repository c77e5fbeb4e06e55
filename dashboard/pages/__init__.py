"""Dashboard pages, one module an area; each module holds its views and its `urlpatterns`."""
