"""The Django project: what a tenant does to jobs (`jobs`), the machinery that runs them (`execution`),
tenancy, the catalog, the REST API and web pages, the OpenAI-compatible API (`openai_api`), webhooks,
audit, operations (`ops`) and the development stack (`devstack`). docs/architecture.md tells how they
fit; `make lint` holds the boundaries between them."""
