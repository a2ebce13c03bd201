"""Settings of the example: a payments API whose POST /payments/ is idempotent."""

import os

from psycopg.conninfo import conninfo_to_dict

_dsn = conninfo_to_dict(os.environ.get("PAYMENTS_DSN", "dbname=payments"))

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
ROOT_URLCONF = "payments_site.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "pg_idempotency.django",  # its migrations install the idempotency schema
    "ledger",
]
MIDDLEWARE = [
    # POST /refunds/ is protected by the middleware (routes below); /payments/ by the decorator.
    "pg_idempotency.django.IdempotencyMiddleware",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3
        "NAME": _dsn.get("dbname", "payments"),
        "USER": _dsn.get("user", ""),
        "PASSWORD": _dsn.get("password", ""),
        "HOST": _dsn.get("host", ""),
        "PORT": _dsn.get("port", ""),
        "ATOMIC_REQUESTS": os.environ.get("PAYMENTS_ATOMIC_REQUESTS") == "1",
    }
}

PG_IDEMPOTENCY = {
    # Whose keys these are. A real app uses the authenticated user (the default scope).
    "SCOPE": "ledger.views.merchant_of",
    "LEASE": 30,  # seconds a request may run before a retry may take its key over
    "WAIT": 0,  # seconds a retry waits for the attempt in progress before 409
    "ROUTES": {"POST /refunds/": "required"},
}
