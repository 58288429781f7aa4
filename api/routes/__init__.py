"""Routers of the registry API, mounted under /api/v1 by `api.app.create_app`."""
