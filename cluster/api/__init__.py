"""The OpenAI-compatible HTTP layer: the ingress deployment (``ingress``), its FastAPI
routes and middleware (``http_api``, ``admission``), the request schemas (``protocol``,
``openapi_schema``), request preparation and response bodies (``openai_service``), the
request flow (``openai_server``) and SSE streaming (``streaming``); ``run_batch`` serves
the same bodies offline through ``workers.LLM``."""
