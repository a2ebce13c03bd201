#!/usr/bin/env python
"""python manage.py migrate && python manage.py runserver (PAYMENTS_DSN names the database)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "payments_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
