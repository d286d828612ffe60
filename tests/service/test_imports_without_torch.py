"""Every module of service/, of the engine under it (engine/) and of the bundle format they read
(bundle/) must import with torch and transformers unavailable, and all but the Ray Serve front end
without ray; so must the ``xmcserve`` package and its command (``xmcserve serve`` and ``predict``
import the training stack only when a command that trains runs)."""

from tests.import_probe import import_all

BLOCKED = ("torch", "transformers", "sentence_transformers")


def test_service_imports_without_torch_or_transformers():
    result = import_all(("service", "engine", "bundle", "xmcserve"), BLOCKED)
    assert result.returncode == 0, result.stderr
    assert "xmcserve.cli" in result.stdout and "xmcserve.model" in result.stdout
    assert "service.http.app" in result.stdout and "engine.search" in result.stdout
    assert "bundle.labels" in result.stdout and "bundle.ivfpq_file" in result.stdout


def test_the_blocker_really_blocks():
    result = import_all(("torch",), BLOCKED)
    assert result.returncode != 0 and "blocked import of torch" in result.stderr


def test_everything_but_the_ray_front_end_imports_without_ray():
    result = import_all(("service", "engine", "bundle"), ("ray", *BLOCKED), skipped=("service.ray_serve",))
    assert result.returncode == 0, result.stderr
    assert "service.http.app" in result.stdout and "service.ray_serve" not in result.stdout
