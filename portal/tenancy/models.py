"""Tenants share the GPUs; members act for them; quotas bound what each may hold at once."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.dispatch import Signal
from django.utils import timezone

rows_updated = Signal()
"""Sent after an `AuthQuerySet.update()` changed rows, with `sender` (the model) and `update_fields` (the
fields written), as `post_save` is after a save: `key_cache` bumps the auth epoch on both."""


class AuthQuerySet(models.QuerySet):
    """Rows that decide what an API key grants (tenants, memberships, keys): an `update()` over them (an admin
    action's, a service's, `bulk_update`'s) is announced (`rows_updated`) as saving a row is, so the key cache
    forgets what it read before."""

    def update(self, **kwargs: Any) -> int:
        changed = super().update(**kwargs)
        if changed:
            rows_updated.send(sender=self.model, update_fields=frozenset(kwargs))
        return changed


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    priority = models.PositiveSmallIntegerField(
        default=5,
        validators=[MaxValueValidator(9)],
        help_text="0 (lowest) to 9 (highest); becomes the Celery priority of the tenant's shards.",
    )
    weight = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.01), MaxValueValidator(1000.0)],
        help_text="Fair-share weight: on each GPU class, tenants with work waiting get GPU time in proportion "
        "to their weights.",
    )
    storage_prefixes = models.JSONField(
        default=list,
        blank=True,
        help_text="URI prefixes the tenant's API callers may read inputs from besides their uploads, "
        'e.g. ["s3://datasets/acme/", "file:///srv/data/acme/"].',
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = AuthQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner"
        ADMIN = "admin"
        MEMBER = "member"
        VIEWER = "viewer"

    # Each role may do what the roles after it may.
    RANKS: dict[str, int] = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2, Role.OWNER: 3}

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = AuthQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="one_membership_per_user_and_tenant")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


DEFAULT_MAX_QUEUED_RECORDS = 10_000_000
"""A new tenant's records in jobs not yet ended: room for a few large jobs, not for flooding the planner."""
DEFAULT_MAX_STORED_BYTES = 50 * 1024**3
"""A new tenant's uploads kept at once: uploads without an expiry stay until deleted."""


class Quota(models.Model):
    """Limits checked at submission with this row locked; an empty limit means no limit."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    max_concurrent_jobs = models.PositiveIntegerField(null=True, blank=True, default=10)
    max_queued_records = models.PositiveBigIntegerField(null=True, blank=True, default=DEFAULT_MAX_QUEUED_RECORDS)
    max_input_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    gpu_seconds_per_month = models.PositiveBigIntegerField(null=True, blank=True)
    max_stored_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        default=DEFAULT_MAX_STORED_BYTES,
        help_text="Bytes of uploads (job inputs and /v1/files, with or without an expiry) kept in the platform's "
        "storage at once.",
    )
    monthly_budget = models.DecimalField(
        max_digits=20,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="What the tenant's jobs may cost a calendar month (UTC), in the deployment's currency "
        "(BATCHERY_CURRENCY): a job (or retry) whose hold passes what is left is refused, and a running job "
        "stops when its spend reaches it.",
    )
    allowed_models = models.ManyToManyField(
        "catalog.Model", blank=True, related_name="+", help_text="Empty: every enabled model."
    )
    allowed_gpu_classes = models.ManyToManyField(
        "catalog.GpuClass", blank=True, related_name="+", help_text="Empty: every GPU class."
    )

    def __str__(self) -> str:
        return f"quota of {self.tenant}"


class BudgetHold(models.Model):
    """A submitted (or retried) job's hold, the dry run's `cost.hold`, held against its tenant's
    `monthly_budget` until it ends (its ledger line then counts instead). Written with the quota row locked;
    a hold whose job has ended is no longer counted (`portal.jobs.budget`)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="budget_holds")
    job_id = models.UUIDField(unique=True)
    amount = models.DecimalField(max_digits=30, decimal_places=10)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.amount} held for job {self.job_id}"


class ApiKey(models.Model):
    """A key for programs: shown once at creation, stored as a hash with a short visible prefix."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True, help_text="Shown in lists so a key can be recognised.")
    hashed_key = models.CharField(max_length=64, help_text="SHA-256 of the whole key; the key itself is never stored.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = AuthQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant})"


class FairShareUsage(models.Model):
    """A tenant's recent GPU-seconds on one GPU class, decayed exponentially: the fair-share ledger.

    `usage` is the value at `updated_at`; read it through `portal.execution.fair_share.decayed`.
    The scheduler charges each shard's estimate when it sends it and corrects by the measured time
    when the shard ends, so shards in flight count at once.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="fair_share_usage")
    gpu_class = models.ForeignKey("catalog.GpuClass", on_delete=models.CASCADE, related_name="fair_share_usage")
    usage = models.FloatField(default=0.0, help_text="Decayed GPU-seconds at updated_at.")
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "gpu_class"], name="unique_usage_per_tenant_class")]

    def __str__(self) -> str:
        return f"{self.tenant} on {self.gpu_class_id}: {self.usage:.1f} GPU-s"


def invitation_backed() -> models.Q:
    """Invitations whose inviter may still make them: an active user who is still an admin or owner of the
    invitation's tenant (an owner, for an invitation to the owner role). One made by someone since removed,
    demoted or deactivated (or deleted) is not honoured, however it lost the right."""
    # One filter() call: both conditions on `inviter__memberships` are about the same membership row.
    same_tenant = models.Q(inviter__is_active=True, inviter__memberships__tenant=models.F("tenant"))
    owner = Membership.Role.OWNER
    return same_tenant & (
        models.Q(role=owner, inviter__memberships__role=owner)
        | (~models.Q(role=owner) & models.Q(inviter__memberships__role__in=[Membership.Role.ADMIN, owner]))
    )


class Invitation(models.Model):
    """A tenant admin's offer of a role, which becomes a membership only when the invited person accepts.

    The invitee is named by user name or email (or both); an invitation to a name with no account yet
    waits, and is matched when an operator creates that account. The token (for an accept link) is
    shown once to the inviter and stored as its SHA-256, like an API key.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    username = models.CharField(max_length=150, blank=True, help_text="The invited user name (or empty).")
    email = models.EmailField(blank=True, help_text="The invited email address (or empty).")
    role = models.CharField(max_length=10, choices=Membership.Role.choices, default=Membership.Role.MEMBER)
    token_digest = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the accept link's token.")
    inviter = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="invitations_sent"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    declined_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=~models.Q(username="", email=""), name="invitation_names_someone")
        ]

    def __str__(self) -> str:
        return f"{self.invitee} to {self.tenant} ({self.role})"

    @property
    def invitee(self) -> str:
        return self.username or self.email

    @property
    def status(self) -> str:
        """pending, accepted, declined, revoked or expired."""
        if self.accepted_at is not None:
            return "accepted"
        if self.declined_at is not None:
            return "declined"
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at <= timezone.now():
            return "expired"
        return "pending"

    def is_for(self, user: Any) -> bool:
        """True if `user` is the person invited (by user name, or by the email on their account)."""
        if self.username and self.username == user.get_username():
            return True
        return bool(self.email and user.email and self.email.lower() == user.email.lower())
