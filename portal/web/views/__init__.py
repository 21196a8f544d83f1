"""The portal's views: thin, tenant-scoped through `portal.web.access.tenant_view`."""
