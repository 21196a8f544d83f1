"""Cursor pages, newest first: stable under inserts, and cheap at any depth."""

from __future__ import annotations

from rest_framework.pagination import CursorPagination


class CreatedCursorPagination(CursorPagination):
    ordering = "-created_at"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500
