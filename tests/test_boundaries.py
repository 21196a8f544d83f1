"""Views, the API, the command line and the admin write through services: none of them calls a model
manager's write, saves or deletes a model instance, or lets Django's admin save by itself."""

from __future__ import annotations

import ast
from pathlib import Path

from tasks.shared.config import REPO_DIR

WRITES = frozenset(
    {"create", "bulk_create", "bulk_update", "get_or_create", "update_or_create", "update", "delete", "save"}
)
ADMIN_WRITES = frozenset({"save_model", "delete_model", "delete_queryset", "save_formset", "save_related"})
ADAPTERS = (
    "portal/*/views.py",
    "portal/*/views/*.py",
    "portal/api/**/*.py",
    "portal/web/**/*.py",
    "portal/*/admin.py",
    "portal/**/management/commands/*.py",
    "portal/audit/cli.py",
)


def _chain(node: ast.expr) -> list[str]:
    """The names along an attribute chain: `Job.objects.filter(...).update` -> [update, filter, objects, Job]."""
    names = []
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names
        else:
            return names


def writes_in(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        method, chain = node.func.attr, _chain(node.func.value)
        by_manager = method in WRITES and "objects" in chain
        by_instance = method in {"save", "delete"} and "objects" not in chain
        by_admin = method in ADMIN_WRITES and isinstance(node.func.value, ast.Call) and chain[-1:] == ["super"]
        if by_manager or by_instance or by_admin:
            found.append(f"{path}:{node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def test_views_api_cli_and_admin_write_only_through_services() -> None:
    files = sorted({path for pattern in ADAPTERS for path in REPO_DIR.glob(pattern) if "migrations" not in path.parts})
    assert len(files) > 30
    assert [write for path in files for write in writes_in(path)] == []


def test_the_check_finds_each_kind_of_write(tmp_path: Path) -> None:
    adapter = tmp_path / "views.py"
    adapter.write_text(
        "def view(request, job, form):\n"
        "    Job.objects.filter(pk=1).update(status='x')\n"
        "    User.objects.get_or_create(username='a')\n"
        "    job.save()\n"
        "    form.save(commit=False)\n"
        "class A:\n"
        "    def save_model(self, request, obj, form, change):\n"
        "        super().save_model(request, obj, form, change)\n"
    )
    found = [line.split(": ", 1)[1] for line in writes_in(adapter)]
    assert found == [
        "Job.objects.filter(pk=1).update(...)",
        "User.objects.get_or_create(...)",
        "job.save(...)",
        "form.save(...)",
        "super().save_model(...)",
    ]
