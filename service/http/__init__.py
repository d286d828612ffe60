"""The HTTP front end: FastAPI app factory, routes, admin API, request schemas, metrics, settings."""
