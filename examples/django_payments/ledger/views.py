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
    try:
        data = json.loads(request.body)
        return str(data["account"]), Decimal(str(data["amount"]))
    except (ValueError, KeyError, TypeError, InvalidOperation):
        return JsonResponse({"error": "expected {\"account\": ..., \"amount\": ...}"}, status=400)


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
    account = Account.objects.select_for_update().get(name=name)
    payment = record(account, -amount)
    transaction.on_commit(lambda: send_receipt(payment.pk))
    return JsonResponse({"id": payment.pk, "amount": str(-amount)}, status=201)
