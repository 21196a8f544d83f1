"""Writing the audit log. Services call `audit_record` where they change something people may need
to trace later (quotas, models, keys, members, jobs, slots), so every entry point is recorded."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from django.contrib.auth.models import User
from django.db import models, transaction
from django.forms import BaseModelFormSet

from portal.audit.models import AuditEntry
from portal.tenancy.models import Tenant

SYSTEM_ACTOR = "system"


class Target(NamedTuple):
    """What an entry is about when it is not a database row, e.g. `Target("slot", "slot0-cpu@host")`."""

    type: str
    id: str


def actor_label(actor: User | None) -> str:
    """How an entry names its actor: the username, or "system" where no user acted (a shell, a task)."""
    return actor.get_username() if actor is not None else SYSTEM_ACTOR


def audit_record(
    *,
    actor: User | None,
    action: str,
    target: models.Model | Target,
    tenant: Tenant | None = None,
    summary: str = "",
    changes: Mapping[str, Sequence[Any]] | None = None,
) -> AuditEntry:
    """Write one entry; `changes` maps a field to its [old, new] values."""
    if isinstance(target, Target):
        target_type, target_id = target
    else:
        target_type, target_id = target._meta.label_lower, str(target.pk)
    return AuditEntry.objects.create(
        actor=actor,
        actor_label=actor_label(actor),
        tenant=tenant,
        action=action,
        target_type=target_type,
        target_id=target_id,
        summary=summary,
        changes={name: list(values) for name, values in (changes or {}).items()},
    )


def field_values(obj: models.Model) -> dict[str, Any]:
    """An object's editable fields as people read them: related objects by name, sets sorted."""
    values: dict[str, Any] = {}
    for field in obj._meta.concrete_fields:
        if not field.editable or field.primary_key:
            continue
        if field.is_relation:
            related = getattr(obj, field.name)
            values[field.name] = None if related is None else str(related)
        else:
            values[field.name] = field.value_from_object(obj)
    if obj.pk is not None:
        for m2m in obj._meta.many_to_many:
            values[m2m.name] = sorted(str(item) for item in getattr(obj, m2m.name).all())
    return values


def stored_field_values(obj: models.Model) -> dict[str, Any] | None:
    """`field_values` of the object as the database holds it now (None if it is not saved yet), read
    before a form's changes are saved over it."""
    if obj.pk is None:
        return None
    stored = type(obj)._default_manager.filter(pk=obj.pk).first()
    return None if stored is None else field_values(stored)


def changed_values(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Field to [old, new], for the fields whose values differ."""
    names = dict.fromkeys([*before, *after])
    return {name: [before.get(name), after.get(name)] for name in names if before.get(name) != after.get(name)}


def audit_change(
    *,
    actor: User | None,
    action: str,
    target: models.Model,
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
    tenant: Tenant | None = None,
) -> AuditEntry | None:
    """Record an object created (no `before`), changed, or about to be deleted (no `after`), with the
    fields that differ; nothing when none does."""
    changes = changed_values(before or {}, after or {})
    if not changes:
        return None
    verb = "created" if before is None else "deleted" if after is None else "changed"
    return audit_record(
        actor=actor,
        action=action,
        target=target,
        tenant=tenant,
        summary=f"{target._meta.verbose_name} {target} {verb}: {', '.join(changes)}",
        changes=changes,
    )


def audited_save(*, obj: models.Model, actor: User | None, action: str, tenant: Tenant | None = None) -> None:
    """Save an object edited by hand (an admin form) and record what changed."""
    before = None if obj._state.adding else stored_field_values(obj)
    obj.save()
    audit_change(actor=actor, action=action, target=obj, before=before, after=field_values(obj), tenant=tenant)


def audited_delete(
    *, objs: Iterable[models.Model], actor: User | None, action: str, tenant: Tenant | None = None
) -> None:
    """Delete objects by hand (an admin action), each recorded with the values it had, all or none."""
    with transaction.atomic():
        for obj in objs:
            audit_change(actor=actor, action=action, target=obj, before=field_values(obj), after=None, tenant=tenant)
            obj.delete()


def audited_formset_save(
    *, formset: BaseModelFormSet, actor: User | None, action: str, tenant: Tenant | None = None
) -> None:
    """Save the rows of a validated inline formset (an admin page's inlines) and record each row created,
    changed or deleted."""
    # Read what the database holds before the forms' values are saved over it.
    before = {
        row.instance.pk: stored_field_values(row.instance)
        for row in formset.initial_forms
        if row.has_changed() or row in formset.deleted_forms
    }
    for row in formset.deleted_forms:
        if row.instance.pk in before:
            audit_change(
                actor=actor,
                action=action,
                target=row.instance,
                before=before[row.instance.pk],
                after=None,
                tenant=tenant,
            )
    formset.save()
    for obj in formset.new_objects:
        audit_change(actor=actor, action=action, target=obj, before=None, after=field_values(obj), tenant=tenant)
    for obj, _ in formset.changed_objects:
        audit_change(
            actor=actor, action=action, target=obj, before=before.get(obj.pk), after=field_values(obj), tenant=tenant
        )
