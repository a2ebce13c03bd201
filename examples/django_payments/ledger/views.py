import json
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.db.models import F
from django.http import HttpRequest, JsonResponse

from pg_idempotency.django import idempotent

from .models import Account, LedgerLine, Payment, Receipt


def merchant_of(request: HttpRequest) -> str | None:
    """The scope of the keys: the caller (here a header; use request.user in a real app)."""
    merchant = request.headers.get("X-Merchant")
    return f"merchant:{merchant}" if merchant else None


def send_receipt(payment_id: int) -> None:
    """Runs on commit: only once the payment and its stored response are committed."""
    Receipt.objects.create(payment_id=payment_id)


def record(account: Account, amount: Decimal) -> Payment:
    with transaction.atomic():  # nested: a savepoint inside the decorator's atomic block
        payment = Payment.objects.create(account=account, amount=amount)
        LedgerLine.objects.bulk_create([
            LedgerLine(payment=payment, side="debit", amount=amount),
            LedgerLine(payment=payment, side="credit", amount=amount),
        ])
        Account.objects.filter(pk=account.pk).update(balance=F("balance") + amount)
    return payment


def _parse(request: HttpRequest) -> tuple[str, Decimal] | JsonResponse:
    """(account, amount), or a 400: a client's mistake is never a 500 from a value the
    columns refuse (a name over 100 characters or with a NUL, an amount over 12 digits)."""
    try:
        data = json.loads(request.body)
        name, amount = data["account"], Decimal(str(data["amount"]))
    except (ValueError, KeyError, TypeError, InvalidOperation):
        name, amount = None, Decimal(0)
    if (isinstance(name, str) and 0 < len(name) <= 100 and name.isprintable()
            and amount.is_finite() and 0 < amount < 10**10 and amount == round(amount, 2)):
        return name, amount
    return JsonResponse({"error": "expected {\"account\": a name, \"amount\": a positive "
                                  "amount with at most 2 decimals}"}, status=400)


@idempotent  # scope, lease, wait: settings.PG_IDEMPOTENCY
def create_payment(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return JsonResponse({"error": "POST only"}, status=405)
    parsed = _parse(request)
    if isinstance(parsed, JsonResponse):
        return parsed  # a 4xx is stored too: the same request gets the same answer
    name, amount = parsed
    account, _ = Account.objects.select_for_update().get_or_create(name=name)
    payment = record(account, amount)
    transaction.on_commit(lambda: send_receipt(payment.pk))
    account.refresh_from_db()
    return JsonResponse({"id": payment.pk, "account": name, "amount": str(amount),
                         "balance": str(account.balance)},
                        status=201, headers={"Location": f"/payments/{payment.pk}"})


def create_refund(request: HttpRequest) -> JsonResponse:
    """Protected by IdempotencyMiddleware (PG_IDEMPOTENCY["ROUTES"]), not by a decorator."""
    parsed = _parse(request)
    if isinstance(parsed, JsonResponse):
        return parsed
    name, amount = parsed
    account = Account.objects.select_for_update().filter(name=name).first()
    if account is None:
        return JsonResponse({"error": f"no account {name!r}"}, status=404)  # stored too
    payment = record(account, -amount)
    transaction.on_commit(lambda: send_receipt(payment.pk))
    return JsonResponse({"id": payment.pk, "amount": str(-amount)}, status=201)
