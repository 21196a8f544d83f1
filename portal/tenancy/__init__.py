"""Tenants, their members and their quotas."""
