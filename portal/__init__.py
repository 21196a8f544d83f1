"""The Django project: tenancy, catalog, jobs and ops apps, and the settings that bind them."""
