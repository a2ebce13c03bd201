"""The pg-idempotency command line (filled in by the migrate work)."""


def main() -> int:
    return 0
