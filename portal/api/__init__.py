"""The REST API under /api/v1/: thin views over the services the CLI and the portal use too."""
