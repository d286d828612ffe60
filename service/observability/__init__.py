"""What operators see of a serving process: structured logs, request ids and OpenTelemetry traces,
shared by both front ends (:mod:`service.http`, :mod:`service.ray_serve`)."""
