"""What a login locked out by django-axes answers: the login page with a message (the API: a 429, see api).

Axes counts failed logins per username and client address (settings.AXES_*); once AXES_FAILURE_LIMIT is reached
even the right password is refused until AXES_COOLOFF_TIME has passed since the last failure.
"""
from __future__ import annotations

import math

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.shortcuts import render


def lockout_message() -> str:
    minutes = math.ceil(settings.AXES_COOLOFF_TIME.total_seconds() / 60)
    return (f"Too many failed logins for this username from your address: logins are blocked for {minutes} minutes "
            f"after the last failed attempt. Wait, then try again (ask an admin to unlock the account sooner).")


def retry_after_s() -> int:
    return int(settings.AXES_COOLOFF_TIME.total_seconds())


def lockout_response(request, original_response=None, credentials=None):
    """AXES_LOCKOUT_CALLABLE: the login page again, status 429, saying why. (The API's token endpoint answers its
    own 429 in the API's error format: api.views.TokenLoginView.)"""
    response = render(request, "registration/login.html",
                      {"form": AuthenticationForm(request), "lockout_message": lockout_message(),
                       "next": request.POST.get("next", "")}, status=429)
    response["Retry-After"] = str(retry_after_s())
    return response
