"""The HTTP API both front ends serve (the uvicorn server, :mod:`service.http`, and the Ray Serve
ingress, :mod:`service.ray_serve`): request and response models (:mod:`service.api.schemas`),
the limits they enforce (:mod:`service.api.limits`) and the refusals made before any work
(:mod:`service.api.body_guards`). Neither front end owns it; both import it, never each other.
"""
