"""Placeholder: pages of this area are being written."""
urlpatterns: list = []
