"""The test project's business model: an order, saved with its outbox row in one transaction."""

from django.db import models


class Order(models.Model):
    reference = models.CharField(max_length=64, unique=True)
    status = models.CharField(max_length=20, default="PENDING")
    #: How many times a result was applied to the order (the inbox keeps it at one).
    completions = models.IntegerField(default=0)

    class Meta:
        app_label = "shop"
