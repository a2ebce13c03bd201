from django.urls import path
from ledger import views

urlpatterns = [
    path("payments/", views.create_payment),
    path("refunds/", views.create_refund),
]
