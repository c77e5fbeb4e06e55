"""ASGI entry point: Django for HTTP, Channels for the run websockets."""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_web.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up)
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from dashboard.auth import TokenAuthMiddlewareStack  # noqa: E402
from dashboard.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(TokenAuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)

from catalog import tokenizers  # noqa: E402

tokenizers.warm_up()  # the first token view would otherwise pay seconds for importing transformers (and torch)
