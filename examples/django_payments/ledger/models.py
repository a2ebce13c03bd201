from django.db import models


class Account(models.Model):
    name = models.CharField(max_length=100, unique=True)
    balance = models.DecimalField(max_digits=12, decimal_places=2, default=0)


class Payment(models.Model):
    account = models.ForeignKey(Account, on_delete=models.PROTECT)
    amount = models.DecimalField(max_digits=12, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)


class LedgerLine(models.Model):
    """Double entry: each payment debits the customer's account and credits revenue."""

    payment = models.ForeignKey(Payment, on_delete=models.PROTECT)
    side = models.CharField(max_length=6)  # "debit" or "credit"
    amount = models.DecimalField(max_digits=12, decimal_places=2)


class Receipt(models.Model):
    """Written by an on_commit callback: one per committed payment (no unique constraint, so
    a second effect would show)."""

    payment_id = models.BigIntegerField()
    sent_at = models.DateTimeField(auto_now_add=True)
